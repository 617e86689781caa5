"""Fork a child of our own parent: `clone(CLONE_PARENT)`, one fork instead of two.

Does what `os.fork()` does around glibc's fork, with the raw system call.
`available()` is False unless glibc's thread block holds this thread's id at
`TID_OFFSET` (x86_64 glibc); `fork_sibling()` refuses (OSError) in a process
with more than one thread. See docs/supervisor.md ("The zygote").
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import sys

CLONE_PARENT = 0x00008000
CLONE_CHILD_SETTID = 0x01000000
CLONE_CHILD_CLEARTID = 0x00200000
_SIGCHLD = 17
_SYS_CLONE_X86_64 = 56  # clone(flags, stack, parent_tid, child_tid, tls)
_SYS_GETTID_X86_64 = 186
TID_OFFSET = 0x2D0  # offsetof(struct pthread, tid), glibc 2.26 and later, x86_64


@functools.cache
def _load() -> ctypes.PyDLL:
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL is not released
    libc.syscall.restype = ctypes.c_long
    libc.pthread_self.restype = ctypes.c_void_p
    return libc


def _tid_address(libc: ctypes.PyDLL) -> int:
    self_thread = libc.pthread_self()
    if not self_thread:
        raise OSError(errno.ENOSYS, "no thread control block")
    return int(self_thread) + TID_OFFSET


@functools.cache
def available() -> bool:
    """Whether `fork_sibling()` can be used here (checked once a process)."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return False
    try:
        libc = _load()
        tid = libc.syscall(_SYS_GETTID_X86_64)
        return bool(tid > 0 and ctypes.c_int.from_address(_tid_address(libc)).value == tid)
    except (OSError, AttributeError, ValueError):
        return False


def single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def fork_sibling() -> int:
    """Fork a process whose parent is our parent: its pid here, 0 in it.
    OSError when the clone fails, is not available, or we have threads."""
    if not available():
        raise OSError(errno.ENOSYS, "clone(CLONE_PARENT) is not available here")
    if not single_threaded():
        raise OSError(errno.EBUSY, "clone(CLONE_PARENT) needs a single-threaded process")
    libc = _load()
    tid_address = _tid_address(libc)
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = libc.syscall(
        _SYS_CLONE_X86_64,
        ctypes.c_ulong(CLONE_PARENT | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | _SIGCHLD),
        None, None, ctypes.c_void_p(tid_address), None)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    failed = ctypes.get_errno() if pid < 0 else 0
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(failed, os.strerror(failed))
    return int(pid)
