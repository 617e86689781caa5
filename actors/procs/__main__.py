"""`python -m actors.procs --state-dir D`: the procs host.

Exit codes: 0 stopped by SIGTERM/SIGINT (every job ended first), 78 the state
directory or the registry is unusable. See docs/procs.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType

import structlog
import zmq

from actors.procs.cgroup import Limits
from actors.procs.facts import Facts
from actors.procs.host import ACTOR_NAME, HostOptions, ProcsHost
from actors.procs.requests import handle
from actors.procs.sandbox import SandboxPolicy
from actors.writer.client import WriterClient
from broker import logconfig
from broker.control import ControlReporter
from broker.errors import StateDirError
from broker.peer import BrokerPeer
from broker.statedir import StateDir

EXIT_CONFIG = 78
REQUEST_TURN_S = 0.05  # requests served per loop turn at most this long, then the chores


def serve_requests(host: ProcsHost, peer: BrokerPeer, budget_s: float = REQUEST_TURN_S) -> bool:
    """Serve waiting requests for at most `budget_s`; True when some are left.

    Bounded so the chores after it (reaping ended children, noting their end,
    settling deferred replies) run every turn however busy the request queue
    is: an unbounded drain starved them while 50 agents kept it non-empty, so
    no ended command was settled (no `.end`, no `proc_exit`) and the janitor,
    which prunes only settled jobs, removed nothing (docs/storage.md)."""
    deadline = time.monotonic() + budget_s
    while (item := peer.recv(0)) is not None:
        handle(host, *item)
        if time.monotonic() >= deadline:
            return True
    return False


class _Stop:
    def __init__(self) -> None:
        self.stopped = False
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the poll through the fd

    def _set(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopped = True


def serve(state: StateDir, options: HostOptions, broker_heartbeat_s: float) -> int:
    stop = _Stop()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # a pulse: heartbeats go on while the loop waits on the writer (docs/procs.md)
    reporter = ControlReporter.from_env(ctx, ACTOR_NAME, pulse=True)
    name = reporter.actor if reporter is not None else ACTOR_NAME
    peer = BrokerPeer(ctx, state, name, heartbeat_interval_s=broker_heartbeat_s)
    writer = WriterClient(ctx, state, origin=ACTOR_NAME)
    log = structlog.get_logger(ACTOR_NAME)
    try:
        host = ProcsHost(state, peer, Facts(writer, watch=reporter), options, reporter)
        if reporter is not None:
            reporter.ready()
        log.info("procs_started", jobs=len(host.jobs))
        backlog = False  # requests left waiting when the last turn's budget ran out
        while not stop.stopped:
            poller = zmq.Poller()
            poller.register(peer.socket, zmq.POLLIN)
            poller.register(stop.read_fd, zmq.POLLIN)
            for fd in host.terminal_fds():
                poller.register(fd, zmq.POLLIN)
            timeout_s = options.tick_s if host.busy() else min(0.5, broker_heartbeat_s / 2)
            events = dict(poller.poll(0 if backlog else int(timeout_s * 1000)))
            if stop.read_fd in events:
                os.read(stop.read_fd, 4096)
            backlog = serve_requests(host, peer)
            host.reap()
            host.refresh()
            peer.tick()
            if reporter is not None:
                reporter.tick(lambda: dict(host.statistics().model_dump()))
        log.info("procs_stop_requested")
        host.shutdown()
        log.info("procs_stopped", **host.statistics().model_dump())
        return 0
    finally:
        writer.close()
        peer.close()
        if reporter is not None:
            reporter.close()
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.procs", description=__doc__)
    parser.add_argument("--state-dir", default=None)
    logconfig.add_arguments(parser)
    parser.add_argument("--kill-grace-s", type=float, default=1.0)
    parser.add_argument("--command-cap-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--terminal-cap-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--command-lifetime-s", type=float, default=3600.0)
    parser.add_argument("--terminal-lifetime-s", type=float, default=1800.0)
    parser.add_argument("--broker-heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--sandbox", choices=("on", "off"), default="on",
                        help="off: run commands unconfined (a warning is logged)")
    parser.add_argument("--sandbox-network", action="append", default=[], metavar="PATTERN",
                        help="sessions (fnmatch) whose commands may use the network")
    parser.add_argument("--sandbox-hide", action="append", default=None, metavar="PATH",
                        help="host paths hidden from commands (default: /run)")
    parser.add_argument("--bwrap", default="bwrap", help="the bubblewrap executable")
    parser.add_argument("--cgroups", choices=("on", "off"), default="on",
                        help="off: run jobs without a control group where none is usable")
    parser.add_argument("--limit-processes", type=int, default=Limits.processes,
                        help="processes of one job at most (0: no limit)")
    parser.add_argument("--limit-memory-bytes", type=int, default=Limits.memory_bytes,
                        help="memory of one job at most (0: no limit)")
    parser.add_argument("--limit-cpu-weight", type=int, default=Limits.cpu_weight,
                        help="a job's CPU weight (1..10000, 100: an equal share)")
    parser.add_argument("--limit-workspace-bytes", type=int, default=Limits.workspace_bytes,
                        help="bytes one job may add to its workspace (0: no limit)")
    parser.add_argument("--tmp-bytes", type=int, default=SandboxPolicy.tmp_bytes,
                        help="size of the sandbox's /tmp (0: unsized)")
    args = parser.parse_args(argv)
    try:
        state = StateDir.at(args.state_dir).ensure()
    except StateDirError as exc:
        print(f"procs: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logconfig.configure(ACTOR_NAME, state.log_path(ACTOR_NAME), level=args.log_level,
                        max_bytes=args.log_max_bytes, backups=args.log_backups, console=False)
    options = HostOptions(
        kill_grace_s=args.kill_grace_s,
        command_cap_bytes=args.command_cap_bytes,
        terminal_cap_bytes=args.terminal_cap_bytes,
        command_lifetime_s=args.command_lifetime_s,
        terminal_lifetime_s=args.terminal_lifetime_s,
        sandbox=SandboxPolicy(
            enabled=args.sandbox == "on", network=tuple(args.sandbox_network),
            hide=tuple(args.sandbox_hide) if args.sandbox_hide is not None
            else SandboxPolicy.hide, bwrap=args.bwrap, cgroups=args.cgroups == "on",
            tmp_bytes=args.tmp_bytes),
        limits=Limits(processes=args.limit_processes, memory_bytes=args.limit_memory_bytes,
                      cpu_weight=args.limit_cpu_weight,
                      workspace_bytes=args.limit_workspace_bytes),
    )
    return serve(state, options, args.broker_heartbeat_interval_ms / 1000.0)


if __name__ == "__main__":
    sys.exit(main())
