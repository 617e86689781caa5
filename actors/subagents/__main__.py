"""`python -m actors.subagents --state-dir D`: the subagents host.

Exit codes: 0 stopped by SIGTERM/SIGINT (a restart resumes the children from
their streams), 78 the state directory is unusable. See docs/changesets.md
("The host and the ops").
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import structlog
import zmq

from actors.changesets.manifest import Limits
from actors.subagents.host import ACTOR_NAME, SubagentsHost
from actors.subagents.remotepack import PackLimits
from actors.writer.client import WriterClient
from broker import lifeline, protocol, ratelimit, skeleton
from broker.control import ControlReporter
from broker.errors import ChangeSetRefusedError, CorralError
from broker.peer import BrokerPeer
from broker.statedir import StateDir

# The loop sleeps in one poll of the broker socket and the wakeup pipe; it
# wakes at least this often to heartbeat the broker and the supervisor.
TICK_S = 0.25
_log = structlog.get_logger(ACTOR_NAME)
_limiter = ratelimit.LogLimiter(_log.warning)


def handle(host: SubagentsHost, sender: str, message: protocol.Message) -> None:
    try:  # another host's subagents actor (docs/fleet.md, "Subagents on another host")
        if host.remote.take(sender, message):
            return
    except Exception:  # noqa: BLE001 - a hostile frame stops nothing: logged (rate limited)
        if _limiter.allow():
            _log.exception("remote_frame_failed", kind=message.kind, sender=sender[:140])
        return
    if protocol.is_reply(message):
        return  # an error (or any reply) nobody here asked for: never answered
    try:
        _handle(host, sender, message)
    except Exception:  # noqa: BLE001 - the last line of defence: logged (rate limited)
        if _limiter.allow():
            _log.exception("request_failed", kind=message.kind)
        host.peer.send(sender, protocol.Error(
            msg_id=getattr(message, "msg_id", None), code=protocol.ErrorCode.INTERNAL_ERROR,
            detail=f"subagents failed to handle {message.kind}"))


def _handle(host: SubagentsHost, sender: str, message: protocol.Message) -> None:
    reply: protocol.Message | None = None
    match message:
        case protocol.Ping(msg_id=msg_id):
            reply = protocol.Pong(msg_id=msg_id, actor=host.peer.name, pid=os.getpid())
        case protocol.StatsRequest(msg_id=msg_id):
            reply = protocol.Stats(msg_id=msg_id, actor=host.peer.name,
                                   values=host.statistics().model_dump())
        case protocol.SpawnSubagent():
            try:
                child = host.spawn(message)
            except (ChangeSetRefusedError, CorralError, OSError) as exc:
                reply = protocol.Error(msg_id=message.msg_id,
                                       code=protocol.ErrorCode.INVALID_MESSAGE,
                                       detail=str(exc)[:2000])
            else:
                msg_id = message.msg_id
                host.defer(sender, lambda: child.state not in ("running", "exited"),
                           lambda: host.reply(msg_id, child), message.wait_s)
        case protocol.SubagentChanges() | protocol.ApplySubagent():
            child = host.find(message.parent, message.subagent_id)  # type: ignore[assignment]
            if child is None or child.parent != message.parent:
                reply = protocol.Error(msg_id=message.msg_id, code=protocol.ErrorCode.NOT_FOUND,
                                       detail=f"no subagent {message.subagent_id} of "
                                       f"{message.parent}")
            elif isinstance(message, protocol.ApplySubagent):
                reply = host.apply(message.msg_id, child)
            else:
                if child.host is not None and child.state == "running":  # on another host:
                    host.remote.nudge(child)  # its change set asked for again, if lost
                msg_id, found = message.msg_id, child
                host.defer(sender, lambda: found.state not in ("running", "exited"),
                           lambda: host.reply(msg_id, found), message.wait_s)
        case _:
            reply = protocol.Error(msg_id=getattr(message, "msg_id", None),
                                   code=protocol.ErrorCode.UNEXPECTED_MESSAGE,
                                   detail=f"subagents does not serve {message.kind}")
    if reply is not None:
        host.peer.send(sender, reply)


def serve(proc: skeleton.Process, state: StateDir, limits: Limits, *, use_zygote: bool = True,
          log_args: list[str] | None = None, fleet_host: str | None = None,
          remote: bool = False, pack_limits: PackLimits | None = None,
          cow: bool = True) -> int:
    log = structlog.get_logger(ACTOR_NAME)
    # SIGCHLD wakes the poll too: an exited child is reaped at once, not on the next tick
    wake = proc.stop_on_signals(wakeup=True, children=True)
    if use_zygote:
        try:  # the zygote's double-forked children must be adopted by this process
            lifeline.become_subreaper()
        except OSError as exc:
            log.warning("subreaper_refused", error=str(exc), fallback="fresh interpreters")
            use_zygote = False
    ctx = proc.context()
    # a pulse: heartbeats go on while the loop waits on the writer or a build
    reporter = ControlReporter.from_env(ctx, ACTOR_NAME, pulse=True)
    if reporter is not None:
        proc.on_close(reporter.close)
    peer = BrokerPeer(ctx, state, reporter.actor if reporter else ACTOR_NAME)
    proc.on_close(peer.close)
    writer = WriterClient(ctx, state, origin=ACTOR_NAME)
    proc.on_close(writer.close)
    host = SubagentsHost(state, peer, writer, limits, use_zygote=use_zygote,
                         log_args=log_args, fleet_host=fleet_host, remote=remote,
                         pack_limits=pack_limits, cow=cow)
    host.watch = reporter
    if reporter is not None:
        reporter.ready()
    log.info("subagents_started", children=len(host.children.records),
             zygote=host.starter.use_zygote, cow=host.cow)
    poller = zmq.Poller()
    poller.register(wake.read_fd, zmq.POLLIN)
    watched: zmq.Socket[bytes] | None = None
    while not wake.stopped:
        if watched is not peer.socket:  # replaced on reconnect
            if watched is not None:
                poller.unregister(watched)
            watched = peer.socket
            poller.register(watched, zmq.POLLIN)
        while (item := peer.recv(0)) is not None:  # also heartbeats the broker
            handle(host, *item)
        host.reap()
        host.settle()
        if reporter is not None:
            reporter.tick(lambda: dict(host.statistics().model_dump()))
        wait_s = TICK_S
        due = host.next_deadline()
        if due is not None:
            wait_s = min(wait_s, max(0.0, due - time.monotonic()))
        events = dict(poller.poll(math.ceil(wait_s * 1000)))
        if wake.read_fd in events:
            wake.drain()
    host.shutdown(wake.read_fd)
    log.info("subagents_stopped", **host.statistics().model_dump())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.subagents", description=__doc__)
    skeleton.add_arguments(parser)
    parser.add_argument("--max-files", type=int, default=64)
    parser.add_argument("--max-input-bytes", type=int, default=256 * 1024)
    parser.add_argument("--max-patch-bytes", type=int, default=512 * 1024)
    parser.add_argument("--no-zygote", action="store_true",
                        help="start every child as a fresh interpreter (slow; for baselines)")
    parser.add_argument("--no-cow", action="store_true",
                        help="copy the parent's workspace for each child instead of "
                        "mounting an overlay of it (docs/changesets.md)")
    # fleet mode (docs/fleet.md, "Subagents on another host")
    parser.add_argument("--fleet-host", default=None, help="this host's name in the fleet")
    parser.add_argument("--remote-subagents", action="store_true",
                        help="place children on other hosts and run theirs here")
    parser.add_argument("--remote-max-files", type=int, default=PackLimits.max_files)
    parser.add_argument("--remote-max-bytes", type=int, default=PackLimits.max_bytes)
    proc = skeleton.Process(ACTOR_NAME)
    return proc.run(lambda: _run(proc, parser.parse_args(argv)))


def _run(proc: skeleton.Process, args: argparse.Namespace) -> int:
    state = proc.state_dir(args.state_dir)
    proc.configure_logging(state, args, console=False)
    limits = Limits(max_files=args.max_files, max_input_bytes=args.max_input_bytes,
                    max_patch_bytes=args.max_patch_bytes)
    # child agents log like their host
    log_args = ["--log-level", args.log_level, "--log-max-bytes", str(args.log_max_bytes),
                "--log-backups", str(args.log_backups)]
    return serve(proc, state, limits, use_zygote=not args.no_zygote, log_args=log_args,
                 fleet_host=args.fleet_host, remote=args.remote_subagents,
                 pack_limits=PackLimits(max_files=args.remote_max_files,
                                        max_bytes=args.remote_max_bytes),
                 cow=not args.no_cow)


if __name__ == "__main__":
    sys.exit(main())
