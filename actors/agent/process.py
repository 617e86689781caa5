"""The agent process shell: what runs in one agent's OS process.

Rebuilds the state before `ready`, steps the loop, answers pings; exit codes
0, 75 and 78. See docs/agents.md ("Specs and process") and
docs/supervisor.md ("Exit codes").
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from actors.agent.loop import AgentLoop, Step
from actors.kernel.settings import read_spec
from actors.procs.client import end_session_quietly
from actors.writer.client import WriterClient
from broker import logconfig, protocol, skeleton
from broker.control import ENV_CONTROL, ControlReporter, stall_from_env
from broker.errors import ConfigError, CorralError
from broker.peer import BrokerPeer
from broker.statedir import StateDir

EXIT_OK = 0
EXIT_STOPPED = 75  # stopped with its session still open: restart it
EXIT_CONFIG = 78


@dataclass(frozen=True)
class AgentOptions:
    """Per-process settings the supervisor passes down."""

    heartbeat_interval_s: float = 1.0
    broker_heartbeat_interval_s: float = 1.0
    broker_heartbeat_misses: int = 3
    log_level: str = "info"
    log_max_bytes: int = logconfig.DEFAULT_MAX_BYTES
    log_backups: int = logconfig.DEFAULT_BACKUPS
    join_broker: bool = True


def serve(name: str, state_dir: StateDir, options: AgentOptions) -> int:
    """Run one agent (its loop, or idle without a spec) until done or SIGTERM.
    Called in a fresh interpreter (actors/agent/__main__.py) and in a child
    forked from the zygote: both set their signals and log up here."""
    proc = skeleton.Process(name, exits=())
    return proc.run(partial(_serve, proc, state_dir, options))


def _serve(proc: skeleton.Process, state_dir: StateDir, options: AgentOptions) -> int:
    name = proc.name
    stop = proc.stop_on_signals(wakeup=True)
    log = proc.configure_logging(state_dir, options, console=False)
    ctx = proc.context()
    endpoint = os.environ.get(ENV_CONTROL)
    reporter = (  # a pulse: heartbeats go on while the loop waits in a call
        ControlReporter(ctx, endpoint, name, interval_s=options.heartbeat_interval_s,
                        pulse=True, stall_s=stall_from_env())
        if endpoint else None
    )
    loop: AgentLoop | None = None
    if reporter is not None:
        def close_reporter() -> None:
            over = loop is not None and loop.state.phase in ("finished", "closed")
            reporter.close(linger_ms=200 if over else 0)  # let the final beat leave

        proc.on_close(close_reporter)
        reporter.connect()  # its handshake overlaps the rest of the start; beats after ready
    peer = (
        BrokerPeer(
            ctx, state_dir, name,
            heartbeat_interval_s=options.broker_heartbeat_interval_s,
            heartbeat_misses=options.broker_heartbeat_misses,
        )
        if options.join_broker else None
    )
    if peer is not None:
        proc.on_close(peer.close)
    try:
        spec = read_spec(state_dir, name)
        if spec is not None:
            writer = WriterClient(ctx, state_dir, name)
            proc.on_close(writer.close)
            if reporter is not None:  # a full disk: beats go on while the writer says so
                writer.storage_waiting = reporter.touch
            loop = AgentLoop(name, state_dir, spec, writer, peer=peer, watch=reporter)
            proc.on_close(loop.trees.close)
            loop.rebuild()
    except ConfigError as exc:
        log.error("agent_spec_invalid", error=str(exc))
        return EXIT_CONFIG
    except CorralError as exc:
        log.error("agent_rebuild_failed", error=str(exc))
        return EXIT_STOPPED
    if reporter is not None:
        reporter.ready()
    log.info("agent_started", join_broker=peer is not None, has_task=loop is not None)
    if loop is not None:
        return _run_loop(loop, stop=stop, peer=peer, reporter=reporter, name=name,
                         options=options, log=log)
    with reporter.idle() if reporter is not None else nullcontext():
        pongs = _serve_idle(stop, peer, reporter, name, options)
    log.info("agent_stopped", pongs_total=pongs)
    return EXIT_OK


def _watch_peer(poller: zmq.Poller, peer: BrokerPeer | None,
                watched: zmq.Socket[bytes] | None) -> zmq.Socket[bytes] | None:
    """Poll the peer's current socket: a reconnect replaces it."""
    if peer is not None and watched is not peer.socket:
        if watched is not None:
            poller.unregister(watched)
        watched = peer.socket
        poller.register(watched, zmq.POLLIN)
    return watched


def _serve_idle(stop: skeleton.Stop, peer: BrokerPeer | None, reporter: ControlReporter | None,
                name: str, options: AgentOptions) -> int:
    """An agent without a task: answer pings until stopped; the pongs answered.
    It is idle throughout: `reporter.idle()` around it (no heartbeats to the
    supervisor) and `peer.hush()` (none with the broker either: docs/broker.md,
    "Idle peers"); it wakes only for a frame, a reconnect or a stop."""
    pongs = 0
    poller = zmq.Poller()
    poller.register(stop.read_fd, zmq.POLLIN)
    watched = None
    monitor = None
    if peer is not None:
        peer.hush()
        monitor = peer.monitor
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
    while not stop.stopped:
        watched = _watch_peer(poller, peer, watched)
        events = dict(poller.poll(-1))
        if stop.read_fd in events:
            stop.drain()
        if peer is not None:
            answered = 0
            while (item := peer.recv(0)) is not None:
                answered += 1
                pongs += _answer(peer, name, *item)
            if answered:
                peer.hush()  # an answer told the broker we speak again: idle once more
            peer.tick()  # quiet: only a new connection is told that we are idle
            if peer.monitor is not monitor:  # a reconnect replaced the monitor too
                if monitor is not None:
                    poller.unregister(monitor)
                monitor = peer.monitor
                if monitor is not None:
                    poller.register(monitor, zmq.POLLIN)
        if reporter is not None:
            reporter.tick(partial(_pong_counters, pongs))
    return pongs


def _run_loop(
    loop: AgentLoop, *, stop: skeleton.Stop, peer: BrokerPeer | None,
    reporter: ControlReporter | None, name: str, options: AgentOptions, log: Any,
) -> int:
    """Step the agent loop; between steps answer pings and send heartbeats."""
    poller = zmq.Poller()
    poller.register(stop.read_fd, zmq.POLLIN)
    watched = None
    wait_ms = loop.settings.approval_poll_ms
    last = Step.PROGRESS
    try:
        while not stop.stopped:
            watched = _watch_peer(poller, peer, watched)
            events = dict(poller.poll(0 if last is Step.PROGRESS else wait_ms))
            if stop.read_fd in events:
                stop.drain()
                continue
            if peer is not None:
                while (item := peer.recv(0)) is not None:
                    _answer(peer, name, *item)
                peer.tick()
            if last is Step.WAIT:
                loop.sync()
            last = loop.step()
            if reporter is not None:
                reporter.tick(loop.values)
            if last is Step.DONE:
                if peer is not None:  # the session is over: end its commands and terminals
                    end_session_quietly(peer, name)
                if reporter is not None:
                    reporter.beat(loop.values())  # the supervisor sees phase finished/closed
                log.info("agent_done", reason=loop.state.exit_reason, turn=loop.state.turn)
                return EXIT_OK
        # stopped: what is pending is made durable, so a stop does not lose a
        # result (a restart would settle its call by the abort rule instead)
        loop.flush()
    except CorralError as exc:
        log.error("agent_loop_failed", error=str(exc))
        return EXIT_STOPPED
    log.info("agent_stopped", phase=loop.state.phase, turn=loop.state.turn)
    return EXIT_STOPPED


def _pong_counters(pongs: int) -> dict[str, int | float]:
    return {"pongs_total": pongs}


def _answer(peer: BrokerPeer, name: str, sender: str, message: protocol.Message) -> int:
    """Reply to what an idle agent understands; refuse the rest with an error."""
    match message:
        case protocol.Ping(msg_id=msg_id):
            peer.send(sender, protocol.Pong(msg_id=msg_id, actor=name, pid=os.getpid()), 1.0)
            return 1
        case _ if protocol.is_reply(message):
            return 0  # never answer a reply, an error above all (no error loops)
        case _:
            ref: str | None = getattr(message, "msg_id", None)
            peer.send(sender, protocol.Error(
                msg_id=ref, code=protocol.ErrorCode.UNEXPECTED_MESSAGE,
                detail=f"idle agent {name} does not serve {message.kind}",
            ), 1.0)
            return 0
