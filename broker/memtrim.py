"""Memory that comes back: once a burst of traffic is over (a flood, a fuzz
run, a thousand connections closed), give the heap's free pages back to the
system with glibc's `malloc_trim`, which glibc itself does only at the top of
the main heap and never for the arenas of ZeroMQ's I/O threads.
docs/protocol.md, "Memory" says what a server holds and gives back.

A `Trimmer` is ticked once per turn of a server's loop: a busy turn costs
nothing; on a quiet turn it trims when INTERVAL_S passed since the last trim
(about 1 ms for a heap of 100 MB: 0.05% of a core). Connections closing are
not traffic the loop sees, so the trim is by the clock, not after traffic.
Without glibc (musl, macOS) it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

INTERVAL_S = 2.0  # at most one trim this often, on a quiet turn


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]  # type: ignore[attr-defined]
    trim.restype = ctypes.c_int  # type: ignore[attr-defined]
    return trim


_TRIM = _load_trim()


def trim() -> bool:
    """Give the free pages of every malloc arena back; False without glibc."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class Trimmer:
    """Trim on a quiet turn, at most once every `interval_s`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.trims_total = 0
        self._next = time.monotonic() + interval_s

    def tick(self, busy: bool) -> None:
        """One turn of the loop; `busy`: it handled traffic (then: nothing)."""
        if busy:
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            if trim():
                self.trims_total += 1
