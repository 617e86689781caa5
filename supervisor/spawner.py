"""Starting children: a command in a fresh process, or an agent through the zygote.

Every child starts in its own session (so its process group is its pid and a
kill reaches its descendants), with PDEATHSIG tied to the supervisor's main
thread and a getppid() check after setting it. The environment carries
CORRAL_CONTROL (the supervisor's control endpoint) and CORRAL_ACTOR (the
child's name); the rest of the supervisor's environment is inherited (tests
rely on that to find leaked processes).

The supervisor reaps every child itself with waitpid(-1): nothing here waits
for a process. ZygoteLink also serves the subagents host, which starts a
zygote of its own for child agents (actors/subagents/starter.py).
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import sys
import time
from collections.abc import Mapping, Sequence

from broker.control import ENV_ACTOR, ENV_CONTROL
from broker.errors import SpawnError
from supervisor import zygote
from supervisor.lifeline import die_with_parent

_EXEC_FAILED = 127


def child_env(base: Mapping[str, str], control_endpoint: str, name: str) -> dict[str, str]:
    env = dict(base)
    env[ENV_CONTROL] = control_endpoint
    env[ENV_ACTOR] = name
    return env


def spawn_command(
    argv: Sequence[str], env: Mapping[str, str], *, pass_fds: Sequence[int] = ()
) -> int:
    """Fork and exec `argv` in a new session; return its pid or raise SpawnError."""
    if not argv:
        raise SpawnError("empty command")
    parent = os.getpid()
    err_read, err_write = os.pipe()  # close-on-exec: EOF means the exec worked
    args = [os.fsencode(a) for a in argv]
    envb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_read)
            os.setsid()
            if not die_with_parent(parent):
                os._exit(_EXEC_FAILED)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            for fd in pass_fds:
                os.set_inheritable(fd, True)
            os.execvpe(args[0], args, envb)  # noqa: S606 - our own interpreters, no shell
        except OSError as exc:
            os.write(err_write, str(exc.errno or errno.EIO).encode())
        finally:
            os._exit(_EXEC_FAILED)
    os.close(err_write)
    try:
        data = os.read(err_read, 32)
    finally:
        os.close(err_read)
    if data:
        os.waitpid(pid, 0)
        code = int(data)
        raise SpawnError(f"cannot execute {argv[0]!r}: {os.strerror(code)}")
    return pid


def signal_group(pid: int, sig: int) -> bool:
    """Signal the process group `pid` leads; False if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:  # the leader may have left its group empty but still be a zombie
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
    return True


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
            argv = [sys.executable, "-m", "supervisor.zygote", "--fd", str(theirs.fileno()),
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
                gate_fd: int | None = None) -> bool:
        """Ask for one agent (its stdout/stderr to `output`, held at the start
        gate `gate_fd` if given); False when the zygote is not there (or its
        queue is full)."""
        if self.sock is None:
            return False
        data = zygote.fork_request(name, output)
        try:
            if gate_fd is None:
                self.sock.send(data)
            else:
                socket.send_fds(self.sock, [data], [gate_fd])
        except (BlockingIOError, OSError):
            return False
        return True

    def replies(self) -> list[zygote.Forked | zygote.ForkFailed]:
        """Every reply available now (a `ready` only sets `self.ready`)."""
        out: list[zygote.Forked | zygote.ForkFailed] = []
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
                reply = zygote.parse_reply(data)
            except ValueError:
                continue
            if isinstance(reply, zygote.Ready):
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
             gate_fd: int | None = None) -> zygote.Forked | zygote.ForkFailed | None:
        """Ask for one agent and wait for its reply; None when the zygote is
        gone or did not answer within `timeout_s` (it may still fork later:
        pass a start gate and close it to make that agent exit unrun)."""
        if not self.request(name, output, gate_fd):
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
