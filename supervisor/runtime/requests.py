"""The operator's per-child requests (start, stop, restart, remove, spawn,
signal) and the reload, on a running supervisor.

See docs/supervisor.md ("Start, stop, restart").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from broker import protocol
from broker.errors import ConfigError
from supervisor.config import CORE_KINDS, DEFAULT_CONFIG_PATH, KIND_ORDER
from supervisor.config import load as load_config
from supervisor.runtime import reload as reload_plan
from supervisor.runtime import spawner
from supervisor.runtime.children import Child

if TYPE_CHECKING:
    from actors.kernel.settings import Budget
    from supervisor.runtime.face import RuntimeFace

log = structlog.get_logger("supervisor")
Reply = protocol.Ack | protocol.Error


def _error(msg_id: str, code: protocol.ErrorCode, detail: str) -> protocol.Error:
    return protocol.Error(msg_id=msg_id, code=code, detail=detail)


def _lookup(rt: RuntimeFace, msg_id: str, target: str, verb: str) -> Child | protocol.Error:
    if rt.stopping:
        return _error(msg_id, protocol.ErrorCode.SHUTTING_DOWN, "the supervisor is stopping")
    child = rt.children.get(target)
    if child is None:
        return _error(msg_id, protocol.ErrorCode.NOT_FOUND, f"no child named {target!r}")
    if child.kind in CORE_KINDS and verb in ("stop", "remove"):
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE,
                      f"{target} is the {child.kind}: everything depends on it; use "
                      f"`supervisor restart {target}` or stop the whole tree")
    if verb == "remove" and child.kind != "agent":
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE,
                      f"{target} is a {child.kind} child: remove it from the configuration "
                      f"and reload")
    return child


def _is_down(child: Child) -> bool:
    return child.pid is None and not child.fork_pending


def _take_down(rt: RuntimeFace, child: Child, now: float) -> None:
    """SIGTERM a held/removed child, or settle it at once when it has no process."""
    child.restart_at = None
    child.restart_requested = False
    if child.pid is not None:
        if child.state != "stopping":
            rt.terminate(child, now)
        return
    rt.starter.withdraw(child)  # not asked of the zygote yet: it never will be
    if child.fork_pending:
        child.state = "stopping"  # forked any moment: the runtime stops it on registration
        return
    if child.removing:
        forget(rt, child)
    else:
        child.state = "stopped"


def forget(rt: RuntimeFace, child: Child) -> None:
    rt.children.pop(child.name, None)
    log.info("child_removed", child=child.name)


def stop(rt: RuntimeFace, msg_id: str, target: str, now: float) -> Reply:
    child = _lookup(rt, msg_id, target, "stop")
    if isinstance(child, protocol.Error):
        return child
    if child.held and _is_down(child):
        return protocol.Ack(msg_id=msg_id, affected=[])  # already stopped
    child.held = True
    log.info("stop_child_requested", child=target, state=child.state)
    _take_down(rt, child, now)
    return protocol.Ack(msg_id=msg_id, affected=[target])


def _adopt(rt: RuntimeFace, target: str) -> None:
    """An agent with a spec on disk but no child (a fork: docs/trees.md; or one
    spawned before this supervisor started) becomes a child, as `spawn` adds one."""
    from actors.kernel.settings import read_spec  # noqa: PLC0415
    from broker.errors import CorralError  # noqa: PLC0415
    from broker.statedir import check_actor_name  # noqa: PLC0415
    from supervisor.config import ChildSpec  # noqa: PLC0415

    if rt.stopping or target in rt.children:
        return
    try:
        check_actor_name(target)
        spec = read_spec(rt.state_dir, target)
    except CorralError as exc:
        log.warning("start_spec_unreadable", child=target, error=str(exc))
        return
    if spec is None:
        return
    template = rt.config.agents.child_template()
    template["restart"] = "transient"  # a session that finished (exit 0) stays down
    agent_spec = ChildSpec(name=target, kind="agent", **template)
    child = rt.children[target] = Child(spec=agent_spec, policy=agent_spec.policy())
    child.spawned_by_operator = True
    child.state = "stopped"
    log.info("child_adopted", child=target, reason="start of an agent with a spec")


def start(rt: RuntimeFace, msg_id: str, target: str, now: float) -> Reply:
    _adopt(rt, target)
    child = _lookup(rt, msg_id, target, "start")
    if isinstance(child, protocol.Error):
        return child
    if child.removing:
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE, f"{target} is being removed")
    was_held, child.held = child.held, False
    if not _is_down(child):
        if was_held:  # still stopping: start it again once it is down
            child.restart_requested = True
            return protocol.Ack(msg_id=msg_id, affected=[target])
        return protocol.Ack(msg_id=msg_id, affected=[])  # already running
    if child.state in ("starting", "backoff") and not was_held:
        return protocol.Ack(msg_id=msg_id, affected=[])  # on its way up already
    log.info("start_child_requested", child=target, state=child.state)
    child.history.clear()
    child.restart_at = None
    _begin(rt, child, now)
    return protocol.Ack(msg_id=msg_id, affected=[target])


def _begin(rt: RuntimeFace, child: Child, now: float) -> None:
    """Start now, or let the start phase start it with its kind."""
    starter = rt.starter
    if child.kind == "agent" and starter.use_zygote and starter.zygote is None \
            and starter.zygote_restart_at is None:
        rt.starter.start_zygote(now)  # it preloads meanwhile; agents wait in the fork queue
    if rt.phase > KIND_ORDER.index(child.spec.kind):
        rt.start(child, now)
    else:
        child.state = "starting"
        child.requested_at = None


def remove(rt: RuntimeFace, msg_id: str, target: str, now: float) -> Reply:
    from actors.kernel.settings import spec_path  # noqa: PLC0415 - only this request needs it

    child = _lookup(rt, msg_id, target, "remove")
    if isinstance(child, protocol.Error):
        return child
    path = spec_path(rt.state_dir, target)
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return _error(msg_id, protocol.ErrorCode.INTERNAL_ERROR,
                      f"cannot delete {path}: {exc.strerror}")
    log.info("remove_requested", child=target, state=child.state, spec=str(path))
    child.held = child.removing = True
    _take_down(rt, child, now)
    return protocol.Ack(msg_id=msg_id, affected=[target])


def tighter(a: Budget, b: Budget) -> Budget:
    """Each bound the smaller of the two (None is unbounded)."""
    from actors.kernel.settings import Budget  # noqa: PLC0415

    def low(x: float | None, y: float | None) -> float | None:
        return y if x is None else x if y is None else min(x, y)

    tokens = low(a.tokens, b.tokens)
    return Budget(tokens=None if tokens is None else int(tokens),
                  cost_units=low(a.cost_units, b.cost_units))


def spawn(rt: RuntimeFace, msg: protocol.SpawnRequest, now: float, *,
          creator: str | None = None, budget: Budget | None = None) -> Reply:
    """Add an agent child with the agents group's policy, but restart `transient`:
    it runs a session, and a finished one exits 0. `creator`: the agent whose
    grants and budget bound this one (a schedule's run, actors/procs/grants.py);
    `budget`: what is left of that agent's, the most the new agent may spend."""
    from actors.kernel.settings import AgentSpec, load_task, write_spec  # noqa: PLC0415
    from actors.sessions.ids import is_session_id, new_session_id  # noqa: PLC0415
    from supervisor.config import ChildSpec  # noqa: PLC0415

    msg_id, name = msg.msg_id, msg.name
    if rt.stopping:
        return _error(msg_id, protocol.ErrorCode.SHUTTING_DOWN, "the supervisor is stopping")
    child = rt.children.get(name)
    if child is not None and child.kind != "agent":
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE,
                      f"a child named {name!r} is the {child.kind}")
    if child is not None and (not _is_down(child) or child.removing
                              or child.state not in ("exited", "fatal", "stopped")):
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE,
                      f"a child named {name!r} is {child.state}")
    if msg.task is None or not msg.task.startswith("/"):
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE,
                      "spawn needs the task file's absolute path")
    try:
        settings = rt.config.agent
        if msg.backend == "pipeline":  # a pipeline runner: its task is the run file
            from actors.agent import catalog  # noqa: PLC0415
            from actors.pipelines import runfile  # noqa: PLC0415

            catalog.install()  # the ops a pipeline's steps may name
            runfile.read(msg.task).parsed()
            settings = runfile.runner_settings(settings)
        else:
            load_task(msg.task)
        if budget is not None:  # the creator's remainder, within the configured bounds
            settings = settings.model_copy(update={"budget": tighter(settings.budget, budget)})
        spec = AgentSpec(task=msg.task, backend=msg.backend, model=msg.model,
                         replay_stream=msg.replay_stream, settings=settings, creator=creator,
                         session=msg.session if is_session_id(msg.session)
                         else new_session_id())  # a new session if the last one is over
        write_spec(rt.state_dir, name, spec)
    except ConfigError as exc:
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE, str(exc)[:1900])
    except OSError as exc:
        return _error(msg_id, protocol.ErrorCode.INTERNAL_ERROR,
                      f"cannot write the spec of {name}: {exc.strerror}")
    if child is None:
        template = rt.config.agents.child_template()
        template["restart"] = "transient"  # a session that finished (exit 0) stays down
        agent_spec = ChildSpec(name=name, kind="agent", **template)
        child = rt.children[name] = Child(spec=agent_spec, policy=agent_spec.policy())
        child.spawned_by_operator = True
    child.held = False
    child.history.clear()
    log.info("spawn_requested", child=name, backend=msg.backend, task=msg.task)
    _begin(rt, child, now)
    return protocol.Ack(msg_id=msg_id, affected=[name])


def reload(rt: RuntimeFace, msg_id: str, now: float) -> protocol.ReloadReply | protocol.Error:
    path = rt.config_path or DEFAULT_CONFIG_PATH
    if rt.stopping:
        return _error(msg_id, protocol.ErrorCode.SHUTTING_DOWN, "the supervisor is stopping")
    running = {name: reload_plan.Running(c.spec, c.spawned_by_operator)
               for name, c in rt.children.items() if not c.removing}
    try:
        new = load_config(path)
        plan = reload_plan.plan(rt.config, new, running, rt.state_dir)
    except ConfigError as exc:
        log.error("config_reload_refused", config=str(path), error=str(exc),
                  kept="the running configuration")
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE,
                      f"{exc} (the running configuration is kept)"[:1990])
    rt.config = new
    for name in plan.stop:
        child = rt.children[name]
        child.held = child.removing = True
        _take_down(rt, child, now)
    for spec in plan.restart:
        child = rt.children[spec.name]
        child.spec, child.policy = spec, spec.policy()
        if _is_down(child) and child.state == "fatal" and not child.held:
            child.history.clear()  # its spec changed: maybe the fix; try it again
            _begin(rt, child, now)
        elif not _is_down(child):
            if child.state != "stopping" or not child.held:
                child.restart_requested = True
            if child.pid is not None and child.state != "stopping":
                rt.terminate(child, now)
    for spec in plan.start:
        child = rt.children[spec.name] = Child(spec=spec, policy=spec.policy())
        _begin(rt, child, now)
    if plan.zygote_changed:
        rt.starter.use_zygote = new.agents.zygote
        rt.starter.zygote_stale = rt.starter.zygote is not None
    log.info("config_reloaded", config=str(path), started=[s.name for s in plan.start],
             stopped=plan.stop, restarted=[s.name for s in plan.restart],
             unchanged=plan.unchanged)
    return protocol.ReloadReply(
        msg_id=msg_id, config=str(path)[:4096], started=[s.name for s in plan.start],
        stopped=plan.stop, restarted=[s.name for s in plan.restart], unchanged=plan.unchanged)


def _refusal(rt: RuntimeFace, msg_id: str, target: str) -> protocol.Error | None:
    if rt.stopping:
        return _error(msg_id, protocol.ErrorCode.SHUTTING_DOWN, "the supervisor is stopping")
    if target != "all" and target not in rt.children:
        return _error(msg_id, protocol.ErrorCode.NOT_FOUND, f"no child named {target!r}")
    return None


def send_signal(rt: RuntimeFace, msg_id: str, target: str, sig: int) -> Reply:
    """Signal one child's process group, or every child's (`all`)."""
    refused = _refusal(rt, msg_id, target)
    if refused is not None:
        return refused
    chosen = list(rt.children.values()) if target == "all" else [rt.children[target]]
    affected = [c.name for c in chosen if c.pid is not None
                and spawner.signal_group(c.pid, sig)]
    if target != "all" and not affected:
        return _error(msg_id, protocol.ErrorCode.NOT_FOUND,
                      f"{target} has no process (state {rt.children[target].state})")
    log.info("child_signalled", target=target, signal=sig, affected=len(affected))
    return protocol.Ack(msg_id=msg_id, affected=affected)


def restart(rt: RuntimeFace, msg_id: str, target: str, now: float) -> Reply:
    """Stop one child and start it again (or start a fatal or exited one)."""
    refused = _refusal(rt, msg_id, target) or (
        _error(msg_id, protocol.ErrorCode.NOT_FOUND, "restart takes one child's name")
        if target == "all" else None)
    if refused is not None:
        return refused
    child = rt.children[target]
    if child.removing:
        return _error(msg_id, protocol.ErrorCode.INVALID_MESSAGE, f"{target} is being removed")
    child.held = False  # a restart also ends an operator's stop
    log.info("restart_requested", child=target, state=child.state)
    if child.pid is not None:
        child.restart_requested = True
        if child.state != "stopping":
            rt.terminate(child, now)
    elif not child.fork_pending:
        child.history.clear()  # the operator resets a fatal or exited child
        child.restart_at = None
        child.restarts += 1
        rt.start(child, now)
    return protocol.Ack(msg_id=msg_id, affected=[target])


def answer(rt: RuntimeFace, msg: protocol.Message, now: float) -> Reply | protocol.ReloadReply:
    """The reply to an operator's request on one child (start, stop, restart,
    remove, signal, spawn) or to a reload; an error for what the supervisor
    does not serve (the runtime answers the rest: docs/protocol.md)."""
    match msg:
        case protocol.StopRequest(msg_id=msg_id, target=str() as target):
            return stop(rt, msg_id, target, now)
        case protocol.StartRequest(msg_id=msg_id, target=target):
            return start(rt, msg_id, target, now)
        case protocol.RemoveRequest(msg_id=msg_id, target=target):
            return remove(rt, msg_id, target, now)
        case protocol.ReloadRequest(msg_id=msg_id):
            return reload(rt, msg_id, now)
        case protocol.SignalRequest(msg_id=msg_id, target=target, signal=sig):
            return send_signal(rt, msg_id, target, sig)
        case protocol.RestartRequest(msg_id=msg_id, target=target):
            return restart(rt, msg_id, target, now)
        case protocol.SpawnRequest():
            return spawn(rt, msg, now)
    ref: str | None = getattr(msg, "msg_id", None)
    return protocol.Error(msg_id=ref, code=protocol.ErrorCode.UNEXPECTED_MESSAGE,
                          detail=f"the supervisor does not serve {msg.kind}")
