"""Remove variables from a forked process's environment, /proc/<pid>/environ too.

The names' strings in the exec-time block are overwritten with NULs (the
child's own pages after the fork), so the zygote keeps the model's key.
See docs/supervisor.md ("The zygote").
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

__all__ = ["scrub"]


def _env_block() -> tuple[int, int] | None:
    """(env_start, env_end) of this process (fields 50 and 51 of /proc/self/stat)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def scrub(names: Iterable[str]) -> None:
    """Unset `names` and wipe their strings from the exec'd environment block."""
    wanted = {os.fsencode(n) for n in names}
    if not wanted:
        return
    block = _env_block()
    targets: list[tuple[int, int]] = []
    if block is not None:
        libc = ctypes.CDLL(None)
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
        i = 0
        while (addr := environ[i]) is not None:
            entry = ctypes.string_at(addr)
            if entry.partition(b"=")[0] in wanted and block[0] <= addr < block[1]:
                targets.append((addr, len(entry)))
            i += 1
    for name in wanted:
        os.environ.pop(os.fsdecode(name), None)  # unsetenv: the pointer leaves environ
    for addr, size in targets:  # only strings inside the exec'd block: never the heap's
        ctypes.memset(addr, 0, size)
