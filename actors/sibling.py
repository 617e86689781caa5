"""Fork a child of our own parent: `clone(CLONE_PARENT)`, one fork instead of two.

The zygote (actors/zygote.py) must make each agent a child of *its* parent
(the supervisor, or the subagents host), which reaps it and sees its exit
status. Without this module it double-forks: a go-between forks the agent
and exits, and the agent is adopted by the zygote's parent (a child
subreaper). That is two copies of the preloaded process's page tables, the
go-between's exit, and the agent waiting for its adoption, on every start.
`clone(2)` with CLONE_PARENT makes the new process the caller's *sibling*:
its parent is the caller's parent from the start, for the cost of one fork.

Python has no `os.clone`, so `fork_sibling()` does what `os.fork()` does
around glibc's fork(), with the raw system call in its place:

- `PyOS_BeforeFork()`, the clone, then `PyOS_AfterFork_Child()` or
  `PyOS_AfterFork_Parent()` (CPython's own locks, its thread state, and the
  handlers registered with `os.register_at_fork`, e.g. `random`'s reseed).
  The calls go through `ctypes.PyDLL`, so the GIL stays held across the
  clone, as in `os.fork()`.
- glibc's fork also writes the child's thread id into the thread's control
  block (the `tid` that `raise()`, recursive mutexes and `pthread_join` read)
  by passing its address with CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID; so
  does this clone. That address is `pthread_self() + TID_OFFSET` (glibc's
  `struct pthread` on x86_64); `available()` checks it holds this thread's id
  before any clone, and answers False where it does not (another libc, another
  layout, another architecture): the caller double-forks instead.
- glibc's fork runs the `pthread_atfork` handlers of C libraries and resets
  its own locks for the child; a raw clone does neither. That is safe only in
  a process with one thread, where no lock can be held by another thread at
  the clone: `fork_sibling()` refuses (OSError) when /proc/self/task lists
  more than one. The zygote never starts a thread.
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
