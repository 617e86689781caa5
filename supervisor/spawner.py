"""Starting children: a command in a fresh process, or an agent through the zygote.

Every child starts in its own session (so its process group is its pid and a
kill reaches its descendants), with PDEATHSIG tied to the supervisor's main
thread and a getppid() check after setting it. The environment carries
CORRAL_CONTROL (the supervisor's control endpoint) and CORRAL_ACTOR (the
child's name); the rest of the supervisor's environment is inherited (tests
rely on that to find leaked processes).

The supervisor reaps every child itself with waitpid(-1): nothing here waits.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
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
    """The supervisor's end of the zygote: start it, ask for forks, read replies."""

    def __init__(self, argv_tail: Sequence[str], env: Mapping[str, str]) -> None:
        self._argv_tail = list(argv_tail)
        self._env = dict(env)
        self.sock: socket.socket | None = None
        self.pid: int | None = None

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
        return self.pid

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    def request(self, name: str) -> bool:
        """Ask for one agent; False when the zygote is not there (or its queue is full)."""
        if self.sock is None:
            return False
        try:
            self.sock.send(zygote.fork_request(name))
        except (BlockingIOError, OSError):
            return False
        return True

    def replies(self) -> list[zygote.Forked | zygote.ForkFailed]:
        """Every reply available now."""
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
                out.append(zygote.parse_reply(data))
            except ValueError:
                continue
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def lost(self) -> None:
        """The zygote exited: forget it (the caller restarts it)."""
        self.close()
        self.pid = None
