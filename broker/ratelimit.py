"""A token bucket for log lines about refused or dropped frames.

See docs/broker.md ("Error replies").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

DEFAULT_RATE_PER_S = 5.0
DEFAULT_BURST = 20
SUMMARY_EVERY_S = 1.0


class LogLimiter:
    """`allow()` is True while the bucket holds a token; suppressed lines are
    counted and summarised through `emit` (a structlog-style method)."""

    def __init__(
        self,
        emit: Callable[..., Any],
        *,
        rate_per_s: float = DEFAULT_RATE_PER_S,
        burst: int = DEFAULT_BURST,
        summary_event: str = "frames_rejected_suppressed",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.summary_event = summary_event
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._pending = 0  # suppressed since the last summary
        self._summary_at = self._stamp
        self.suppressed_total = 0

    def allow(self) -> bool:
        """Take a token if there is one; otherwise count the line as suppressed."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate_per_s)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self._summarise(now, force=True)
            return True
        self._pending += 1
        self.suppressed_total += 1
        self._summarise(now, force=False)
        return False

    def tick(self) -> None:
        """Write the pending summary if one is due (call from a loop's housekeeping)."""
        self._summarise(self._clock(), force=False)

    def _summarise(self, now: float, *, force: bool) -> None:
        if not self._pending or (not force and now - self._summary_at < SUMMARY_EVERY_S):
            return
        self._emit(self.summary_event, count=self._pending, suppressed_total=self.suppressed_total)
        self._pending = 0
        self._summary_at = now
