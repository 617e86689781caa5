"""The zygote: a preloaded template process that forks cheap agents.

`python -m actors.zygote --fd N ...`: started by the supervisor (with a
pool) and by the subagents host (without). See docs/supervisor.md ("The
zygote") and docs/decisions.md ("Agents fork from a zygote: one clone, a
pool, paced starts").

The format on its socketpair is actors/zygotewire.py's.
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import select
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import get_args

from actors import sibling
from actors.zygotewire import RUNNABLE, ForkRequest, parse_request
from broker import logconfig
from broker.lifeline import die_with_parent
from broker.statedir import private_umask

EXIT_SOFTWARE = 70
EXIT_GATE_CLOSED = 125  # the start gate closed without "go" (as actors/procs/launch.py)
MAX_DATAGRAM_BYTES = 8192  # a request: the word, a name, a path (PATH_MAX 4096)
_REPARENT_WAIT_S = 2.0
_REAP_POLL_MS = 5  # while go-betweens are out: how often the zygote looks for their exits
_OUTPUT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
POOL_FAILURES = 3  # members dead before `ready` in a row: the pool is not refilled
POOL_QUIET_S = 0.1  # the pool is refilled only this long after the last request


def _timeout_ms(poll_ms: int | None, wait_s: float | None) -> int | None:
    """The shorter of a poll interval (ms) and a wait (s); None: no bound."""
    waits = [poll_ms] if poll_ms is not None else []
    if wait_s is not None:
        waits.append(max(1, math.ceil(wait_s * 1000)))
    return min(waits) if waits else None
# Fault injection for tests only: the go-between of the request with this name
# kills itself (SIGKILL) before it forks or replies
FAULT_ENV_GO_BETWEEN_DIES = "CORRAL_FAULT_ZYGOTE_GO_BETWEEN_DIES"
def _preload() -> None:
    """Import and warm everything an agent, the writer, the broker, procs and
    subagents need (RUNNABLE), then freeze it."""
    import zmq  # noqa: F401

    from actors.agent import catalog, process  # noqa: F401
    from broker import protocol

    catalog.install()  # the ops and their union, built once: every forked agent inherits them

    for module in RUNNABLE.values():
        importlib.import_module(module)

    # Build the validators and encoders once, in the template: protocol.py defers
    # them to first use (cheap for a short-lived CLI), which every agent would
    # otherwise pay again after the fork.
    for model in get_args(get_args(protocol.Message)[0]):
        model.model_rebuild()
    frame = protocol.encode(protocol.Heartbeat(actor="zygote", pid=os.getpid()))
    protocol.decode(frame)
    protocol.decode(protocol.encode(protocol.Ping(msg_id="warm")))
    gc.collect()
    gc.freeze()


@dataclass
class _Member:
    """One agent of the pool, as the zygote sees it: its end of the member's
    socketpair, and its pid once it said `ready`."""

    sock: socket.socket
    pid: int | None = None


class Zygote:
    def __init__(self, sock: socket.socket, args: argparse.Namespace) -> None:
        self.sock = sock
        self.args = args
        self.parent_pid = os.getppid()  # the supervisor or the subagents host
        self.middles: dict[int, str | None] = {}  # go-betweens not yet reaped: pid ->
        # request name (None: a pool member's, which nobody waits for)
        self.fault_go_between_dies = os.environ.get(FAULT_ENV_GO_BETWEEN_DIES)
        self.pool_size: int = max(0, getattr(args, "pool", 0))
        self.members: dict[int, _Member] = {}  # by the zygote's socket fd
        self.pool_failures = 0
        self.last_request = 0.0  # monotonic: when the last request came
        self.poller = select.poll()
        # one fork a request, the child our parent's (actors/sibling.py); else go-betweens
        self.clone = not getattr(args, "double_fork", False) and sibling.available()

    def serve(self) -> int:
        try:
            self.sock.send(f"ready {os.getpid()}".encode())
        except OSError:
            return 0  # the parent is gone already
        self.poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            if not self._reap_middles():
                return 0  # the parent is gone
            events = self.poller.poll(0)
            if not events:  # refill only while no request waits: a fork delays it
                quiet_s = self._pool_quiet_s()
                if quiet_s == 0:
                    self._fill_pool()
                    quiet_s = None
                events = self.poller.poll(_timeout_ms(
                    _REAP_POLL_MS if self.middles else None, quiet_s))
            for fd, _event in events:
                if fd != self.sock.fileno():
                    self._member_event(fd)
            if not any(fd == self.sock.fileno() for fd, _event in events):
                continue  # nothing to read yet: look for exited go-betweens again
            try:
                data, fds, _flags, _addr = socket.recv_fds(
                    self.sock, MAX_DATAGRAM_BYTES, 2, socket.MSG_CMSG_CLOEXEC)
            except (InterruptedError, BlockingIOError):
                continue
            if not data:
                return 0  # the parent closed its end
            self.last_request = time.monotonic()
            if not self._serve_request(data, fds):
                return 0  # the parent is gone

    def _pool_quiet_s(self) -> float | None:
        """How long until the pool may be refilled: 0 now, None when it need
        not be (full, off, given up). Not within POOL_QUIET_S of a request: in
        a burst the forks would take the CPU the starting agents need (a
        burst's requests are served by double forks, as without a pool)."""
        if not self.pool_size or len(self.members) >= self.pool_size \
                or self.pool_failures >= POOL_FAILURES:
            return None
        return max(0.0, self.last_request + POOL_QUIET_S - time.monotonic())

    def _serve_request(self, data: bytes, fds: list[int]) -> bool:
        """Answer one request (a pool member, or a go-between, answers it);
        False when the parent is gone."""
        try:
            request = parse_request(data)
            if request is None:
                return True  # not a request: never answered
            rest = list(fds)
            credential = rest.pop(0) if request.credential and rest else None
            gate = rest[0] if rest else None
            try:
                if request.module is None and self._hand_to_member(request, gate, credential):
                    return True
                pid = self._clone(request, gate, credential) if self.clone else None
                if pid is not None:
                    self.sock.send(f"forked {request.name} {pid}".encode())
                    return True
                middle = self._fork(request, gate, credential)
            except OSError as exc:
                reply = f"failed {request.name} {exc.strerror or exc}"
            except Exception as exc:  # noqa: BLE001 - a bad request (a NUL in the path...)
                reply = f"failed {request.name} {type(exc).__name__}"
            else:
                self.middles[middle] = request.name  # it replies
                return True
            try:
                self.sock.send(reply.encode())
            except OSError:
                return False
            return True
        finally:
            for fd in fds:
                os.close(fd)

    def _fill_pool(self) -> None:
        """Fork members until the pool holds `pool_size` (waiting or on their way)."""
        while self.pool_size and len(self.members) < self.pool_size \
                and self.pool_failures < POOL_FAILURES:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                middle = self._fork(None, None, None, member=(theirs, ours))
            except OSError:
                ours.close()
                self.pool_failures += 1
                return
            finally:
                theirs.close()
            self.middles[middle] = None
            self.members[ours.fileno()] = _Member(ours)
            self.poller.register(ours.fileno(), select.POLLIN)

    def _member_event(self, fd: int) -> None:
        """A member said `ready`, or is gone (EOF, an error)."""
        member = self.members.get(fd)
        if member is None:
            return
        try:
            data = member.sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        word, _, pid = data.decode("ascii", "replace").partition(" ")
        if word == "ready" and pid.isdigit() and member.pid is None:
            member.pid = int(pid)
            return
        self.pool_failures += 1  # it died (or its go-between did) before any request
        self._drop_member(fd)

    def _drop_member(self, fd: int) -> None:
        member = self.members.pop(fd)
        self.poller.unregister(fd)
        member.sock.close()

    def _hand_to_member(self, request: ForkRequest, gate: int | None,
                        credential: int | None) -> bool:
        """Give an agent request to the oldest waiting member and answer
        `forked` with its pid; False when none could take it."""
        for fd, member in list(self.members.items()):
            if member.pid is None:
                continue
            output = os.open(request.output, _OUTPUT_FLAGS, 0o600) if request.output else None
            passed = [x for x in (output, credential, gate) if x is not None]
            header = json.dumps({"name": request.name, "output": output is not None,
                                 "credential": credential is not None,
                                 "gate": gate is not None}).encode()
            try:
                socket.send_fds(member.sock, [header], passed)
            except OSError:
                self._drop_member(fd)  # it died meanwhile: the next one, or a fork
                continue
            finally:
                if output is not None:
                    os.close(output)
            pid = member.pid
            self._drop_member(fd)
            self.pool_failures = 0
            self.sock.send(f"forked {request.name} {pid}".encode())
            return True
        return False

    def _reap_middles(self) -> bool:
        """Reap the go-betweens that have exited; answer `failed` for one that
        died without replying (it exits 0 only once its reply is sent). False
        when the parent is gone (a reply could not be sent)."""
        while self.middles:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.middles.clear()
                break
            if pid == 0:
                break
            if pid not in self.middles:
                continue
            name = self.middles.pop(pid)
            if name is None or status == 0:
                continue  # a pool member's go-between: its member's socket says the rest
            try:
                self.sock.send(f"failed {name} the go-between process failed".encode())
            except OSError:
                return False
        return True

    def _clone(self, request: ForkRequest, gate: int | None,
               credential: int | None) -> int | None:
        """Fork the child for `request` as our parent's child directly (one
        fork, no go-between, nothing to adopt); its pid, or None when the
        clone cannot be made here (the go-betweens serve the request then)."""
        output = os.open(request.output, _OUTPUT_FLAGS, 0o600) if request.output else None
        try:
            pid = sibling.fork_sibling()
        except OSError:
            if output is not None:
                os.close(output)
            return None
        if pid == 0:
            self._become_agent(request, output, gate, credential)  # never returns
        if output is not None:
            os.close(output)
        return pid

    def _fork(self, request: ForkRequest | None, gate: int | None, credential: int | None,
              member: tuple[socket.socket, socket.socket] | None = None) -> int:
        """Fork the go-between, which forks the agent and replies; its pid.
        With no request, the agent forked is a pool member on `member`'s first
        socket (the second is the zygote's end, closed in the member)."""
        output = os.open(request.output, _OUTPUT_FLAGS, 0o600) \
            if request is not None and request.output else None
        try:
            middle = os.fork()
        except BaseException:
            if output is not None:
                os.close(output)
            raise
        if middle == 0:  # the go-between: fork the agent, reply, vanish
            code = EXIT_SOFTWARE
            try:
                if request is None:
                    assert member is not None
                    member[1].close()  # the zygote's end: EOF must reach the member
                    pid = os.fork()
                    if pid == 0:
                        self._become_member(member[0])  # never returns
                    member[0].send(f"ready {pid}".encode())  # before this exit adopts it
                    os._exit(0)
                if request.name == self.fault_go_between_dies:
                    os.kill(os.getpid(), signal.SIGKILL)
                try:
                    pid = os.fork()
                except OSError as exc:
                    reply = f"failed {request.name} {exc.strerror or exc}"
                else:
                    if pid == 0:
                        self._become_agent(request, output, gate, credential)  # never returns
                    reply = f"forked {request.name} {pid}"
                self.sock.send(reply.encode())
                code = 0  # replied
            except BaseException:  # noqa: BLE001 - nothing may escape a forked child
                code = EXIT_SOFTWARE
            finally:
                os._exit(code)
        if output is not None:
            os.close(output)
        return middle

    def _adopted(self, keep: socket.socket | None = None) -> None:
        """In a forked agent: drop the zygote's sockets (but `keep`), leave its
        session, wait to be adopted by the zygote's parent, die with it."""
        self.sock.close()
        for member in self.members.values():
            if member.sock is not keep:
                member.sock.close()
        os.setsid()
        deadline = time.monotonic() + _REPARENT_WAIT_S
        while os.getppid() != self.parent_pid:
            if time.monotonic() > deadline:
                os._exit(EXIT_SOFTWARE)  # not adopted: the zygote's parent is gone
            time.sleep(0.0002)
        if not die_with_parent(self.parent_pid):
            os._exit(EXIT_SOFTWARE)

    def _become_member(self, sock: socket.socket) -> None:
        """A pool member: adopted, then wait for a request (EOF: exit 0)."""
        try:
            self._adopted(keep=sock)
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_DATAGRAM_BYTES, 3)
            sock.close()
            if not data:
                os._exit(0)  # the zygote is gone, or stopped keeping a pool
            header = json.loads(data)
            rest = list(fds)
            output = rest.pop(0) if header["output"] else None
            credential = rest.pop(0) if header["credential"] else None
            gate = rest.pop(0) if header["gate"] else None
            request = ForkRequest(str(header["name"]), credential=credential is not None)
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            os._exit(EXIT_SOFTWARE)
        self._run_agent(request, output, gate, credential)

    def _become_agent(self, request: ForkRequest, output: int | None, gate: int | None,
                      credential: int | None) -> None:
        try:
            self._adopted()
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            os._exit(EXIT_SOFTWARE)
        self._run_agent(request, output, gate, credential)

    def _run_agent(self, request: ForkRequest, output: int | None, gate: int | None,
                   credential: int | None) -> None:
        """Adopted: take the output, pass the gate, take the credential, run."""
        name = request.name
        code = EXIT_SOFTWARE
        try:
            if output is not None:
                os.dup2(output, 1)
                os.dup2(output, 2)
                os.close(output)
            if gate is not None:
                if os.read(gate, 1) != b"g":
                    os._exit(EXIT_GATE_CLOSED)
                os.close(gate)
            from broker import auth

            if credential is not None:  # this child's own, from the requester's pipe
                auth.set_process_credential(auth.read_credential(credential))

            os.environ["CORRAL_ACTOR"] = name
            if request.module is not None:  # a system child: the writer, broker, procs...
                from actors import envscrub

                envscrub.scrub(request.drop)  # also from /proc/<pid>/environ
                code = _run_main(RUNNABLE[request.module], request.argv)
                return
            from actors.agent.process import AgentOptions, serve
            from broker.statedir import StateDir

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


def _run_main(module: str, argv: tuple[str, ...]) -> int:
    """`main(argv)` of `module`, ending with the code `python -m` would: its
    return, sys.exit's (argparse's 2), 1 after an uncaught exception's traceback."""
    try:
        return int(importlib.import_module(module).main(list(argv)) or 0)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - as the interpreter: the traceback, then 1
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.zygote", description=__doc__)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--broker-heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--broker-heartbeat-misses", type=int, default=3)
    parser.add_argument("--pool", type=int, default=0,
                        help="agents kept forked ahead of requests (0: none)")
    parser.add_argument("--double-fork", action="store_true",
                        help="serve requests by go-betweens even where clone(CLONE_PARENT) works")
    logconfig.add_arguments(parser)
    args = parser.parse_args(argv)
    private_umask()  # the agents it forks inherit it
    sock = socket.socket(fileno=args.fd)
    _preload()
    return Zygote(sock, args).serve()


if __name__ == "__main__":
    sys.exit(main())
