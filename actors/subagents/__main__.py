"""`python -m actors.subagents --state-dir D`: the subagents host.

Exit codes: 0 stopped by SIGTERM/SIGINT (children stopped; a restart resumes
them from their streams), 78 the state directory is unusable.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType

import structlog
import zmq

from actors.changesets.manifest import Limits
from actors.subagents.host import ACTOR_NAME, SubagentsHost
from actors.writer_client import WriterClient
from broker import logconfig, protocol
from broker.control import ControlReporter
from broker.errors import ChangeSetRefusedError, CorralError, StateDirError
from broker.peer import BrokerPeer
from broker.statedir import StateDir

EXIT_CONFIG = 78


def handle(host: SubagentsHost, sender: str, message: protocol.Message) -> None:
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
                msg_id, found = message.msg_id, child
                host.defer(sender, lambda: found.state not in ("running", "exited"),
                           lambda: host.reply(msg_id, found), message.wait_s)
        case _:
            reply = protocol.Error(msg_id=getattr(message, "msg_id", None),
                                   code=protocol.ErrorCode.UNEXPECTED_MESSAGE,
                                   detail=f"subagents does not serve {message.kind}")
    if reply is not None:
        host.peer.send(sender, reply)


def serve(state: StateDir, limits: Limits) -> int:
    stopped = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log = structlog.get_logger(ACTOR_NAME)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    reporter = ControlReporter.from_env(ctx, ACTOR_NAME)
    peer = BrokerPeer(ctx, state, reporter.actor if reporter else ACTOR_NAME)
    writer = WriterClient(ctx, state, origin=ACTOR_NAME)
    try:
        host = SubagentsHost(state, peer, writer, limits)
        if reporter is not None:
            reporter.ready()
        log.info("subagents_started", children=len(host.children.records))
        while not stopped:
            item = peer.recv(0.05)
            while item is not None:
                handle(host, *item)
                item = peer.recv(0)
            host.reap()
            host.settle()
            if reporter is not None:
                reporter.tick(lambda: dict(host.statistics().model_dump()))
        host.shutdown()
        log.info("subagents_stopped", **host.statistics().model_dump())
        return 0
    finally:
        writer.close()
        peer.close()
        if reporter is not None:
            reporter.close()
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.subagents", description=__doc__)
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--max-files", type=int, default=64)
    parser.add_argument("--max-input-bytes", type=int, default=256 * 1024)
    parser.add_argument("--max-patch-bytes", type=int, default=512 * 1024)
    args = parser.parse_args(argv)
    try:
        state = StateDir.at(args.state_dir).ensure()
    except StateDirError as exc:
        print(f"subagents: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logconfig.configure(ACTOR_NAME, state.log_path(ACTOR_NAME), level=args.log_level,
                        console=False)
    limits = Limits(max_files=args.max_files, max_input_bytes=args.max_input_bytes,
                    max_patch_bytes=args.max_patch_bytes)
    return serve(state, limits)


if __name__ == "__main__":
    sys.exit(main())
