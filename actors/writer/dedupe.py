"""Idempotency state of the writer: for each origin, the seq of its most recent
`window` keys. A retried (origin, key) inside the window is answered with its
original seq and never written again; the window is saved in every checkpoint
and rebuilt from the WAL tail after it, so it survives a writer restart."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_WINDOW = 256


class DedupeWindows:
    """Bounded per-origin maps key -> seq, oldest evicted first."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("dedupe window must be >= 1")
        self.window = window
        self._by_origin: dict[str, OrderedDict[str, int]] = {}
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
            keys = self._by_origin[origin] = OrderedDict()
        keys[key] = seq
        if len(keys) > self.window:
            keys.popitem(last=False)

    def origins(self) -> int:
        return len(self._by_origin)

    def dump(self) -> dict[str, list[tuple[str, int]]]:
        """Oldest first, for the checkpoint."""
        return {origin: list(keys.items()) for origin, keys in self._by_origin.items()}

    @classmethod
    def load(cls, data: dict[str, list[tuple[str, int]]], window: int) -> DedupeWindows:
        windows = cls(window)
        for origin, pairs in data.items():
            windows._by_origin[origin] = OrderedDict(pairs[-window:])  # (key, seq) pairs
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
