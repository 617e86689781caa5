"""The WAL floor of `procs/<session>` streams: their unsettled starts.

See docs/storage.md ("WAL retention").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.writer.streamindex import StreamIndex
from actors.writer.wal import parse_record

PREFIX = "procs/"
START_EVENTS = frozenset({"proc_start", "terminal_start"})
END_EVENTS = frozenset({"proc_exit", "terminal_end", "proc_lost"})
SESSION_END = "session_end"
LIFETIME_MARGIN_S = 60.0
DEFAULT_LIFETIME_S = 3600.0  # a start without a readable lifetime (procs' command default)
PAGE = 4096

ReadLine = Callable[[int, int, int], bytes]  # (segment first seq, offset, length) -> line


@dataclass
class _Stream:
    scanned: int = 0  # the newest seq read
    open: dict[str, tuple[int, float]] = field(default_factory=dict)  # proc_id -> (seq, expires)


def is_procs_stream(stream: str) -> bool:
    return stream.startswith(PREFIX)


class ProcsFloor:
    """Unsettled starts of every procs stream the writer has seen."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def need(self, stream: str, index: StreamIndex, read_line: ReadLine, floor_seq: int,
             now: float) -> int | None:
        """The lowest seq `stream` needs (its oldest unsettled start), or None:
        nothing below the horizon. `floor_seq`: the WAL's current floor."""
        state = self._streams.setdefault(stream, _Stream())
        # the first pass (from the floor), or records truncated meanwhile
        state.scanned = max(state.scanned, floor_seq - 1)
        state.open = {k: v for k, v in state.open.items() if v[0] >= floor_seq}
        while entries := index.lookup(stream, state.scanned + 1, PAGE):
            for seq, segment, offset, length in entries:
                self._fold(state, seq, read_line(segment, offset, length))
                state.scanned = seq
            if len(entries) < PAGE:
                break
        state.open = {k: v for k, v in state.open.items() if v[1] > now}
        return min((seq for seq, _ in state.open.values()), default=None)

    def forget(self, streams: set[str]) -> None:
        """Streams the index no longer names (compacted away)."""
        for stream in set(self._streams) - streams:
            del self._streams[stream]

    @staticmethod
    def _fold(state: _Stream, seq: int, line: bytes) -> None:
        record = parse_record(line)
        if record is None or record.seq != seq:
            # unreadable: hold it (the old rule for this stream, never less)
            state.open[f"\0unreadable:{seq}"] = (seq, float("inf"))
            return
        if record.event == SESSION_END:
            state.open.clear()
            return
        if record.event not in START_EVENTS and record.event not in END_EVENTS:
            return
        try:
            payload = json.loads(record.payload_bytes())
        except ValueError:
            return
        if not isinstance(payload, dict) or not isinstance(payload.get("proc_id"), str):
            return
        proc_id: str = payload["proc_id"]
        if record.event in END_EVENTS:
            state.open.pop(proc_id, None)
            return
        lifetime = payload.get("lifetime_s")
        if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime < 0:
            lifetime = DEFAULT_LIFETIME_S
        state.open.setdefault(proc_id, (seq, record.ts + float(lifetime) + LIFETIME_MARGIN_S))
