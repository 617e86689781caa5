"""`python -m actors.procs --state-dir D`: the procs host.

Exit codes: 0 stopped by SIGTERM/SIGINT (every job ended first), 78 the state
directory or the registry is unusable. See docs/procs.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import structlog
import zmq

from actors.procs.cgroup import Limits
from actors.procs.facts import Facts
from actors.procs.host import ACTOR_NAME, HostOptions, ProcsHost
from actors.procs.requests import handle
from actors.procs.sandbox import SandboxPolicy
from actors.writer.client import WriterClient
from broker import skeleton
from broker.control import ControlReporter
from broker.peer import BrokerPeer
from broker.statedir import StateDir

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


def serve(proc: skeleton.Process, state: StateDir, options: HostOptions,
          broker_heartbeat_s: float) -> int:
    # SIGCHLD wakes the poll too: an ended job is reaped at once
    stop = proc.stop_on_signals(wakeup=True, children=True)
    ctx = proc.context()
    # a pulse: heartbeats go on while the loop waits on the writer (docs/procs.md)
    reporter = ControlReporter.from_env(ctx, ACTOR_NAME, pulse=True)
    if reporter is not None:
        proc.on_close(reporter.close)
    name = reporter.actor if reporter is not None else ACTOR_NAME
    peer = BrokerPeer(ctx, state, name, heartbeat_interval_s=broker_heartbeat_s)
    proc.on_close(peer.close)
    writer = WriterClient(ctx, state, origin=ACTOR_NAME)
    proc.on_close(writer.close)
    log = structlog.get_logger(ACTOR_NAME)
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
            stop.drain()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.procs", description=__doc__)
    skeleton.add_arguments(parser)
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
    proc = skeleton.Process(ACTOR_NAME)
    return proc.run(lambda: _run(proc, parser.parse_args(argv)))


def _run(proc: skeleton.Process, args: argparse.Namespace) -> int:
    state = proc.state_dir(args.state_dir)
    proc.configure_logging(state, args, console=False)
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
    return serve(proc, state, options, args.broker_heartbeat_interval_ms / 1000.0)


if __name__ == "__main__":
    sys.exit(main())
