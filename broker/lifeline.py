"""Ties children's lives to their parent's (prctl), and starts them so.

PR_SET_CHILD_SUBREAPER and PR_SET_PDEATHSIG (set from the parent's main
thread, getppid() checked after). See docs/supervisor.md ("Process tree").
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
from collections.abc import Mapping, Sequence

from broker.errors import SpawnError

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
_EXEC_FAILED = 127


def _call(option: int, value: int) -> None:
    if _prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def become_subreaper() -> None:
    """Adopt orphaned descendants (the zygote's double-forked agents)."""
    _call(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(expected_ppid: int, sig: int = signal.SIGKILL) -> bool:
    """Ask for `sig` when the parent dies; False if it is already gone.

    Safe to call between fork and exec (no allocation beyond a ctypes call)."""
    _call(PR_SET_PDEATHSIG, sig)
    return os.getppid() == expected_ppid


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


def reap_exited() -> list[tuple[int, int]]:
    """(pid, wait status) of every child that has exited since the last call;
    never blocks. A subreaper gets adopted descendants here too."""
    out: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))
