"""Histogram bucket counts the writer carries in its heartbeat values.

They feed the fsync latency and batch size histograms of the metrics
endpoint. See docs/operations.md ("Metrics").
"""

from __future__ import annotations

from bisect import bisect_left

FSYNC_MS_BOUNDS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)
BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


class Buckets:
    def __init__(self, prefix: str, bounds: tuple[float, ...], sum_key: str) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self._keys = [f"{prefix}{b:g}" for b in bounds] + [f"{prefix}inf"]
        self._sum_key = sum_key

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def values(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(zip(self._keys, self.counts, strict=True))
        out[self._sum_key] = round(self.total, 3)
        return out


def fsync_ms() -> Buckets:
    return Buckets("fsync_ms_le_", FSYNC_MS_BOUNDS, "fsync_ms_sum")


def batch_records() -> Buckets:
    return Buckets("batch_le_", BATCH_BOUNDS, "batch_records_sum")
