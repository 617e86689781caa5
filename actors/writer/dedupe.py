"""The writer's idempotency windows: an origin's newest keys and their seqs.

See docs/decisions.md ("Idempotency is remembered per origin for a bounded
window").
"""

from __future__ import annotations

DEFAULT_WINDOW = 256

Snapshot = dict[str, dict[str, int]]  # origin -> key -> seq, oldest first


class DedupeWindows:
    """Bounded per-origin maps key -> seq, oldest evicted first."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("dedupe window must be >= 1")
        self.window = window
        self._by_origin: dict[str, dict[str, int]] = {}
        self.hits = 0

    def lookup(self, origin: str, key: str) -> int | None:
        keys = self._by_origin.get(origin)
        if keys is None:
            return None
        seq = keys.get(key)
        if seq is not None:
            self.hits += 1
        return seq

    def remember(self, origin: str, key: str, seq: int) -> None:
        keys = self._by_origin.get(origin)
        if keys is None:
            keys = self._by_origin[origin] = {}
        keys[key] = seq  # a key already there keeps its place, as in an OrderedDict
        if len(keys) > self.window:
            del keys[next(iter(keys))]  # the oldest

    def origins(self) -> int:
        return len(self._by_origin)

    def dump(self) -> dict[str, list[tuple[str, int]]]:
        """Oldest first, for the checkpoint."""
        return pairs(self.snapshot())

    def snapshot(self) -> Snapshot:
        """A copy of every window as it is now (cheap: one dict copy each); the
        checkpoint thread makes it the checkpoint's pairs with `pairs`."""
        return {origin: keys.copy() for origin, keys in self._by_origin.items()}

    @classmethod
    def load(cls, data: dict[str, list[tuple[str, int]]], window: int) -> DedupeWindows:
        windows = cls(window)
        for origin, items in data.items():
            windows._by_origin[origin] = dict(items[-window:])  # (key, seq) pairs
        return windows

    def forget_seqs(self, seqs: set[int]) -> int:
        """Drop every key whose seq is in `seqs` (records compaction removed:
        no trace of a purged session stays in the windows); returns how many."""
        dropped = 0
        for origin in list(self._by_origin):
            keys = self._by_origin[origin]
            for key in [k for k, seq in keys.items() if seq in seqs]:
                del keys[key]
                dropped += 1
            if not keys:
                del self._by_origin[origin]
        return dropped


def pairs(snapshot: Snapshot) -> dict[str, list[tuple[str, int]]]:
    """A snapshot as the checkpoint stores it: each origin's (key, seq), oldest first."""
    return {origin: list(keys.items()) for origin, keys in snapshot.items()}
