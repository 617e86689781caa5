"""`supervisor run [CONFIG] [--agents N]`: the main job, end to end.

See docs/agents.md ("Commands").
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import fnmatch
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import yaml

from actors.agent import catalog
from actors.kernel.settings import AgentSpec, write_spec
from actors.kernel.state import AgentState
from actors.sessions.ids import new_session_id
from actors.sessions.rebuild import rebuild, tail
from broker.errors import ConfigError, CorralError, StateDirError
from broker.statedir import StateDir
from supervisor import client
from supervisor import config as config_mod

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_LOCKED = 75
EXIT_CONFIG = 78
START_WAIT_S = 60.0


def task_files(config_path: Path, tasks: list[str]) -> list[Path]:
    base = config_path.resolve().parent
    if tasks:
        return [(base / t).resolve() for t in tasks]
    return sorted((base / "tasks").glob("*.yaml"))


def prepare(config: config_mod.Config, config_path: Path, state_dir: StateDir,
            agents: int) -> tuple[Path, list[str]]:
    """Write the agents' specs and the effective configuration; return both."""
    tasks = task_files(config_path, config.run.tasks)
    if not tasks:
        raise ConfigError(f"{config_path}: run: no task files found")
    group = config.agents.model_copy(update={"count": agents, "restart": "transient"})
    effective = config.model_copy(update={"agents": group})
    names = [f"{group.name_prefix}{i}" for i in range(1, agents + 1)]
    for i, name in enumerate(names):
        write_spec(state_dir, name, AgentSpec(task=str(tasks[i % len(tasks)]),
                                              backend=config.run.backend,
                                              settings=config.agent,
                                              session=new_session_id()))
    path = state_dir.config_dir / "run.yaml"
    path.write_text(yaml.safe_dump(effective.model_dump(mode="json"), sort_keys=False))
    return path, names


class Progress:
    """Live lines on a terminal; a plain line log otherwise."""

    def __init__(self, out: TextIO, names: list[str]) -> None:
        self.out = out
        self.names = names
        self.tty = out.isatty()
        self.drawn = 0
        self.last: dict[str, tuple[str, str | None, str]] = {}

    @staticmethod
    def line(name: str, state: AgentState, proc: str) -> str:
        waiting = " (waiting for approval)" if state.pending_approvals() else ""
        return (f"{name:<12} {state.phase:<9} turn {state.turn:>4}  calls "
                f"{state.counts.tool_calls:>4}  last {state.last_op or '-':<13} {proc}{waiting}")

    def show(self, states: dict[str, AgentState], procs: dict[str, str]) -> None:
        if self.tty:
            if self.drawn:
                self.out.write(f"\x1b[{self.drawn}F")
            for name in self.names:
                self.out.write("\x1b[2K" + self.line(name, states[name], procs.get(name, "?"))
                               + "\n")
            self.drawn = len(self.names)
            self.out.flush()
            return
        for name in self.names:
            state = states[name]
            key = (state.phase, state.last_op, procs.get(name, "?"))
            if self.last.get(name) != key:
                self.last[name] = key
                stamp = time.strftime("%H:%M:%S")
                self.out.write(f"{stamp} {self.line(name, state, procs.get(name, '?'))}\n")
        self.out.flush()


def _answers(config: config_mod.Config, writer: Any, name: str, state: AgentState,
             state_dir: StateDir) -> None:
    from actors.kernel import operator_input
    from supervisor.cli.agents import answer_approval

    for approval in state.pending_approvals():
        for rule in config.run.answers:
            if fnmatch.fnmatchcase(approval.op, rule.op) and fnmatch.fnmatchcase(
                    approval.pattern, rule.pattern):
                try:
                    if approval.kind == "clarification":  # a question gets an answer's text
                        line = operator_input.record_answer(
                            writer, state_dir.agent_dir(name), name, state, approval.request,
                            text=rule.note or rule.decision)
                    else:
                        line = answer_approval(writer, name, state, approval.request,
                                               decision=rule.decision, always=rule.always,
                                               note=rule.note)
                except (LookupError, operator_input.InputRefusedError):
                    break
                print(f"run: {line}", file=sys.stderr if sys.stdout.isatty() else sys.stdout)
                break


def summary(names: list[str], states: dict[str, AgentState], procs: dict[str, str]) -> str:
    rows = [f"{'AGENT':<12} {'RESULT':<10} {'TURNS':>5} {'CALLS':>5} {'REJECTS':>7} "
            f"{'ABORTED':>7} {'TOKENS':>7}  PROCESS"]
    for name in names:
        s = states[name]
        rows.append(f"{name:<12} {s.exit_reason or s.phase:<10} {s.turn:>5} "
                    f"{s.counts.tool_calls:>5} {s.counts.rejects:>7} {s.counts.aborted:>7} "
                    f"{s.budget.tokens_used:>7}  {procs.get(name, '?')}")
    finished = sum(1 for n in names if states[n].phase == "finished")
    rows.append(f"{finished}/{len(names)} agents finished")
    return "\n".join(rows)


def run(config_arg: str | None, state_arg: str | None, agents: int | None,
        timeout_s: float | None) -> int:
    config_path = Path(config_arg) if config_arg else config_mod.DEFAULT_CONFIG_PATH
    try:
        config = config_mod.load(config_path)
        state_dir = StateDir.resolve(state_arg).ensure()
        state_dir.endpoint("supervisor")
        count = max(1, agents if agents is not None else config.run.agents)
        if client.running(state_dir):
            print(f"supervisor: {state_dir.root} is already supervised; use `supervisor spawn`",
                  file=sys.stderr)
            return EXIT_LOCKED
        effective_path, names = prepare(config, config_path, state_dir, count)
    except (ConfigError, StateDirError) as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    out_path = state_dir.logs_dir / "supervisor.out"
    with open(out_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
             "--config", str(effective_path)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=_env())
    try:
        return _follow(proc, config, state_dir, names,
                       timeout_s if timeout_s is not None else config.run.timeout_s)
    except KeyboardInterrupt:
        _stop(proc, state_dir)
        print("supervisor: run interrupted; everything stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if proc.poll() is None:
            _stop(proc, state_dir)


def _env() -> dict[str, str]:
    """Our environment, with this checkout importable (an uninstalled run works too)."""
    import os

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _stop(proc: subprocess.Popen[bytes], state_dir: StateDir) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _children(state_dir: StateDir) -> dict[str, Any] | None:
    from broker import protocol
    from broker.requester import new_msg_id

    try:
        reply = client.ask(state_dir, protocol.StatusRequest(msg_id=new_msg_id("run")),
                           timeout_s=1.0)
    except (CorralError, client.NoSupervisorError):
        return None
    if not isinstance(reply, protocol.StatusReply):
        return None
    return {c.name: c for c in reply.children}


def _follow(proc: subprocess.Popen[bytes], config: config_mod.Config, state_dir: StateDir,
            names: list[str], timeout_s: float) -> int:
    import zmq

    from actors.writer.client import WriterClient

    catalog.install()
    deadline = time.monotonic() + timeout_s
    start_deadline = time.monotonic() + START_WAIT_S
    children: dict[str, Any] | None = None
    while children is None or children.get("writer") is None or \
            children["writer"].state != "running":
        if proc.poll() is not None:
            print(f"supervisor: the runtime exited with {proc.returncode}; see "
                  f"{state_dir.logs_dir / 'supervisor.out'}", file=sys.stderr)
            return EXIT_FAILED
        if time.monotonic() > min(deadline, start_deadline):
            print("supervisor: the runtime did not start", file=sys.stderr)
            return EXIT_FAILED
        time.sleep(0.05)
        children = _children(state_dir)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    writer = WriterClient(ctx, state_dir, "operator")
    progress = Progress(sys.stdout, names)
    procs: dict[str, str] = {}
    try:
        states = {n: rebuild(writer, state_dir, n).state for n in names}
        timed_out = False
        while True:
            children = _children(state_dir) or {}
            for name in names:
                states[name] = tail(writer, name, states[name])
                _answers(config, writer, name, states[name], state_dir)
                child = children.get(name)
                procs[name] = (f"{child.state}" + (f" ({child.last_exit})" if child.last_exit
                                                    and child.pid is None else "")
                               if child is not None else "unknown")
            progress.show(states, procs)
            agents_down = all(
                children.get(n) is not None and children[n].pid is None
                and children[n].state in ("exited", "fatal") for n in names)
            if agents_down:
                break
            if proc.poll() is not None:
                print(f"supervisor: the runtime exited with {proc.returncode}", file=sys.stderr)
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(config.run.refresh_s)
        states = {n: tail(writer, n, states[n]) for n in names}
    finally:
        writer.close()
        ctx.destroy(linger=0)
    _stop(proc, state_dir)
    print(summary(names, states, procs))
    if timed_out:
        print(f"supervisor: run timed out after {timeout_s:g}s", file=sys.stderr)
    ok = all(states[n].phase == "finished" for n in names) and not timed_out
    return EXIT_OK if ok else EXIT_FAILED
