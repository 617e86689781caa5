"""Memory that comes back: glibc's `malloc_trim` on a quiet loop turn.

By the clock, not after traffic; a no-op without glibc. See docs/protocol.md
("Receivers").
"""

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
