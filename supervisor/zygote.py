"""The zygote: a preloaded template process that forks cheap agents.

`python -m supervisor.zygote --fd N ...` is started by the supervisor (a
child with PDEATHSIG like any other). It imports the heavy modules (zmq,
pydantic, structlog, the protocol, the agent shell), builds the validators
once, calls `gc.freeze()` so that a collection in a child does not unshare
the template's pages, and then serves fork requests on the socketpair `N`
(SOCK_SEQPACKET: one datagram per request). It never creates a ZeroMQ context:
contexts do not survive fork; each agent creates its own after the fork.

Who is whose parent: the supervisor is a child subreaper
(supervisor/lifeline.py). The zygote double-forks: an intermediate process
forks the agent and exits at once, so the agent is adopted by the supervisor,
which reaps it and sees its exit status like any other child's. The agent
waits until its parent is the supervisor, then sets PDEATHSIG relative to it
and checks getppid() once more.

The request/reply format on the socketpair (this module owns it):
    request  b"fork <name>"
    reply    b"forked <name> <pid>"   or   b"failed <name> <reason>"
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass

from supervisor.lifeline import die_with_parent

EXIT_SOFTWARE = 70
_REPARENT_WAIT_S = 2.0


@dataclass(frozen=True)
class Forked:
    name: str
    pid: int


@dataclass(frozen=True)
class ForkFailed:
    name: str
    reason: str


def fork_request(name: str) -> bytes:
    return f"fork {name}".encode()


def parse_reply(data: bytes) -> Forked | ForkFailed:
    """Parse one reply datagram; ValueError when it is not one."""
    word, name, rest = data.decode("utf-8", "replace").split(" ", 2)
    if word == "forked":
        return Forked(name, int(rest))
    if word == "failed":
        return ForkFailed(name, rest)
    raise ValueError(f"unknown zygote reply {word!r}")


def _preload() -> None:
    """Import and warm everything an agent needs, then freeze it."""
    import zmq  # noqa: F401

    from actors.agent import process  # noqa: F401
    from broker import protocol

    # Build the validators and encoders once, in the template.
    frame = protocol.encode(protocol.Heartbeat(actor="zygote", pid=os.getpid()))
    protocol.decode(frame)
    protocol.decode(protocol.encode(protocol.Ping(msg_id="warm")))
    gc.collect()
    gc.freeze()


class Zygote:
    def __init__(self, sock: socket.socket, args: argparse.Namespace) -> None:
        self.sock = sock
        self.args = args
        self.supervisor_pid = os.getppid()

    def serve(self) -> int:
        while True:
            try:
                data = self.sock.recv(4096)
            except InterruptedError:
                continue
            if not data:
                return 0  # the supervisor closed its end
            word, _, name = data.decode("utf-8", "replace").partition(" ")
            if word != "fork" or not name:
                continue
            try:
                pid = self._fork(name)
                reply = f"forked {name} {pid}"
            except OSError as exc:
                reply = f"failed {name} {exc.strerror or exc}"
            self.sock.send(reply.encode())

    def _fork(self, name: str) -> int:
        read_fd, write_fd = os.pipe()
        middle = os.fork()
        if middle == 0:  # the intermediate: fork the agent, report its pid, vanish
            code = 0
            try:
                os.close(read_fd)
                pid = os.fork()
                if pid == 0:
                    os.close(write_fd)
                    self._become_agent(name)  # never returns
                os.write(write_fd, str(pid).encode())
            except BaseException:  # noqa: BLE001 - nothing may escape a forked child
                code = EXIT_SOFTWARE
            finally:
                os._exit(code)
        os.close(write_fd)
        try:
            data = b""
            while chunk := os.read(read_fd, 64):
                data += chunk
        finally:
            os.close(read_fd)
            os.waitpid(middle, 0)
        if not data:
            raise OSError(0, "the intermediate process failed to fork")
        return int(data)

    def _become_agent(self, name: str) -> None:
        code = EXIT_SOFTWARE
        try:
            self.sock.close()
            os.setsid()
            deadline = time.monotonic() + _REPARENT_WAIT_S
            while os.getppid() != self.supervisor_pid:
                if time.monotonic() > deadline:
                    os._exit(EXIT_SOFTWARE)  # not adopted: the supervisor is gone
                time.sleep(0.0002)
            if not die_with_parent(self.supervisor_pid):
                os._exit(EXIT_SOFTWARE)
            from actors.agent.process import AgentOptions, serve
            from broker.statedir import StateDir

            os.environ["CORRAL_ACTOR"] = name
            args = self.args
            code = serve(name, StateDir.at(args.state_dir), AgentOptions(
                heartbeat_interval_s=args.heartbeat_interval_ms / 1000.0,
                broker_heartbeat_interval_s=args.broker_heartbeat_interval_ms / 1000.0,
                broker_heartbeat_misses=args.broker_heartbeat_misses,
                log_level=args.log_level,
                log_max_bytes=args.log_max_bytes,
                log_backups=args.log_backups,
            ))
        except BaseException:  # noqa: BLE001 - report, then leave with a code
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor.zygote", description=__doc__)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--broker-heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--broker-heartbeat-misses", type=int, default=3)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-max-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--log-backups", type=int, default=5)
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    _preload()
    return Zygote(sock, args).serve()


if __name__ == "__main__":
    sys.exit(main())
