"""The parent's end of a zygote: start it, ask for forks, read its replies.

Used by the supervisor and the subagents host. See docs/supervisor.md
("The zygote").
"""

from __future__ import annotations

import math
import os
import select
import socket
import sys
import time
from collections.abc import Mapping, Sequence

from actors import zygotewire
from broker.lifeline import spawn_command


class ZygoteLink:
    """The parent's end of the zygote: start it, ask for forks, read replies.

    The supervisor polls `fileno()` in its loop and calls `request()` and
    `replies()`; the subagents host, which forks one child at a time, uses
    `wait_ready()` and `fork()` (a request and its reply, with a deadline)."""

    def __init__(self, argv_tail: Sequence[str], env: Mapping[str, str]) -> None:
        self._argv_tail = list(argv_tail)
        self._env = dict(env)
        self.sock: socket.socket | None = None
        self.pid: int | None = None
        self.ready = False  # the zygote said `ready` (it has preloaded)

    def start(self) -> int:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-m", "actors.zygote", "--fd", str(theirs.fileno()),
                    *self._argv_tail]
            self.pid = spawn_command(argv, self._env, pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.ready = False
        return self.pid

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    def request(self, name: str, output: str | os.PathLike[str] | None = None,
                gate_fd: int | None = None, credential_fd: int | None = None) -> bool:
        """Ask for one agent (its stdout/stderr to `output`, held at the start
        gate `gate_fd` if given, its credential on the pipe `credential_fd`);
        False when the zygote is not there (or its queue is full)."""
        if self.sock is None:
            return False
        data = zygotewire.fork_request(name, output, credential=credential_fd is not None)
        fds = [fd for fd in (credential_fd, gate_fd) if fd is not None]
        try:
            if not fds:
                self.sock.send(data)
            else:
                socket.send_fds(self.sock, [data], fds)
        except (BlockingIOError, OSError):
            return False
        return True

    def run(self, name: str, module: str, argv: list[str], *, drop: Sequence[str] = (),
            credential_fd: int | None = None) -> bool:
        """Ask for a forked child running `python -m <module> <argv>`'s main (the
        writer, broker, procs, subagents: zygotewire.RUNNABLE), without the
        environment names `drop`, its credential on the pipe `credential_fd`;
        False when the zygote is not ready (still preloading, gone, its queue
        full) or does not run `module`: the caller starts a fresh interpreter
        instead. The reply is a `Forked` or `ForkFailed` among `replies()`,
        like an agent's."""
        if self.sock is None or not self.ready or module not in zygotewire.RUNNABLE:
            return False
        data = zygotewire.run_request(name, module, argv, drop=drop,
                                  credential=credential_fd is not None)
        try:
            if credential_fd is None:
                self.sock.send(data)
            else:
                socket.send_fds(self.sock, [data], [credential_fd])
        except (BlockingIOError, OSError):
            return False
        return True

    def run_wait(self, name: str, module: str, argv: list[str], timeout_s: float, *,
                 drop: Sequence[str] = (), credential_fd: int | None = None,
                 ) -> zygotewire.Forked | zygotewire.ForkFailed | None:
        """`run()` and wait for its reply, as `fork()` does for an agent."""
        if not self.run(name, module, argv, drop=drop, credential_fd=credential_fd):
            return None
        deadline = time.monotonic() + timeout_s
        while self._wait_readable(deadline):
            for reply in self.replies():
                if reply.name == name:
                    return reply
        return None

    def replies(self) -> list[zygotewire.Forked | zygotewire.ForkFailed]:
        """Every reply available now (a `ready` only sets `self.ready`)."""
        out: list[zygotewire.Forked | zygotewire.ForkFailed] = []
        while self.sock is not None:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.close()
                break
            try:
                reply = zygotewire.parse_reply(data)
            except ValueError:
                continue
            if isinstance(reply, zygotewire.Ready):
                self.ready = True
            else:
                out.append(reply)
        return out

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the zygote's `ready`; False if it did not
        come (still preloading) or the zygote is gone. Replies read meanwhile
        are dropped: call this before any request."""
        deadline = time.monotonic() + timeout_s
        self.replies()
        while not self.ready and self._wait_readable(deadline):
            self.replies()
        return self.ready

    def fork(self, name: str, timeout_s: float, *, output: str | os.PathLike[str] | None = None,
             gate_fd: int | None = None,
             credential_fd: int | None = None) -> zygotewire.Forked | zygotewire.ForkFailed | None:
        """Ask for one agent and wait for its reply; None when the zygote is
        gone or did not answer within `timeout_s` (it may still fork later:
        pass a start gate and close it to make that agent exit unrun)."""
        if not self.request(name, output, gate_fd, credential_fd):
            return None
        deadline = time.monotonic() + timeout_s
        while self._wait_readable(deadline):
            for reply in self.replies():
                if reply.name == name:
                    return reply
        return None

    def _wait_readable(self, deadline: float) -> bool:
        """Wait until a datagram (or EOF) can be read, or the deadline passes."""
        if self.sock is None:
            return False
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return False
            if poller.poll(remaining_ms):
                return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def lost(self) -> None:
        """The zygote exited: forget it (the caller restarts it)."""
        self.close()
        self.pid = None
        self.ready = False
