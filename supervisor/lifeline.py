"""Ties children's lives to the supervisor's (Linux prctl).

    PR_SET_CHILD_SUBREAPER  the supervisor adopts orphaned descendants, so the
                            agents the zygote double-forks become its children
                            (it reaps them and sees their exit status).
    PR_SET_PDEATHSIG        a child gets SIGKILL when its parent *thread* dies;
                            every child is forked from the supervisor's main
                            thread, which lives as long as the process. The
                            child checks getppid() right after setting it, in
                            case the parent died before.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


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
