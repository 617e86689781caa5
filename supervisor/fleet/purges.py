"""Purged sessions in the fleet's object store: this host's purge ranges read
cheaply and uploaded as `<host>/purges`; an adopter's reading of them.

See docs/fleet.md ("Purged sessions").
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from actors.sessions.ids import index_path
from actors.sessions.purged import Purged, purged_of
from broker.statedir import StateDir

log = structlog.get_logger("supervisor.fleet")

MAX_BYTES = 4 * 1024 * 1024  # an adopter reads no larger purges object
MAX_RANGES = 100_000

Ranges = dict[str, list[Purged]]  # stream -> its purged ranges


class PurgesFormatError(ValueError):
    """A purges object an adopter cannot take (the adoption round fails)."""


def purges_object(host: str) -> str:
    return f"{host}/purges"


def covered(ranges: Ranges, stream: str, seq: int) -> bool:
    return any(p.covers(seq) for p in ranges.get(stream, ()))


def encode(ranges: Ranges) -> bytes:
    """The purges object: stream, range and session id of each purge, no text."""
    rows = [{"stream": stream, "first_seq": p.first_seq, "last_seq": p.last_seq,
             "session_id": p.session_id}
            for stream in sorted(ranges) for p in sorted(ranges[stream],
                                                         key=lambda p: p.first_seq)]
    return json.dumps({"version": 1, "purges": rows}, sort_keys=True).encode()


def decode(data: bytes) -> Ranges:
    """The ranges of a purges object (hostile: a malformed row is refused
    whole, so an adopter never takes a half-read list for the full one)."""
    if len(data) > MAX_BYTES:
        raise PurgesFormatError("purges object too large")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise PurgesFormatError("purges object is not JSON") from exc
    rows = doc.get("purges") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or len(rows) > MAX_RANGES:
        raise PurgesFormatError("purges object without a list of purges")
    out: Ranges = {}
    for row in rows:
        if not isinstance(row, dict):
            raise PurgesFormatError("a purge that is not an object")
        stream, first, last, session = (row.get("stream"), row.get("first_seq"),
                                        row.get("last_seq"), row.get("session_id"))
        if not (isinstance(stream, str) and isinstance(session, str)
                and type(first) is int and type(last) is int):
            raise PurgesFormatError("a purge with a field of the wrong type")
        out.setdefault(stream, []).append(Purged(session, first, last))
    return out


@dataclass
class PurgeWatch:
    """This host's purge ranges per agent stream, read again only when the
    session index (`sessions.sqlite3` or its SQLite WAL) changed. A purge
    counts from its journal row on, as for every reader of the WAL."""

    state_dir: StateDir
    ranges: Ranges = field(default_factory=dict)  # of the streams read, those with a purge
    stamp: tuple[Any, ...] | None = None
    streams: set[str] = field(default_factory=set)  # read since the index last changed

    def read(self, agents: Sequence[str]) -> Ranges:
        """The ranges, those of the agents' streams read again when the index
        changed (or first asked for). An index that cannot be read now keeps
        the last ranges (read again next round)."""
        stamp = self._stamp()
        if stamp != self.stamp:
            self.streams = set()
        wanted = {f"agent/{a}" for a in agents} - self.streams
        if not wanted:
            return self.ranges
        try:
            fresh = {s: purged_of(self.state_dir.root, s) for s in sorted(wanted)}
        except sqlite3.Error:
            return self.ranges
        if stamp != self.stamp:
            self.ranges = {}
        self.stamp = stamp
        self.streams |= wanted
        self.ranges.update({s: found for s, found in fresh.items() if found})
        return self.ranges

    def _stamp(self) -> tuple[Any, ...]:
        path = index_path(self.state_dir.root)
        out: list[Any] = []
        for name in (path, path.with_name(path.name + "-wal")):
            try:
                st = os.stat(name)
            except FileNotFoundError:
                out.append(None)
                continue
            # an empty SQLite WAL is no change: a read-only reader creates one
            out.append((st.st_ino, st.st_mtime_ns, st.st_size) if st.st_size else None)
        return tuple(out)


def visible_records(records: Iterable[dict[str, Any]], ranges: Ranges
                    ) -> list[dict[str, Any]]:
    """The records no purge covers (a record without an int seq is kept: the
    import refuses it on its own terms)."""
    return [r for r in records
            if not (isinstance(r.get("seq"), int) and isinstance(r.get("stream"), str)
                    and covered(ranges, r["stream"], r["seq"]))]


# --- adoption ------------------------------------------------------------------
async def read_dead(bucket: Any, names: list[str], dead: str) -> Ranges:
    """The dead host's purge ranges (its `<host>/purges` object; none when it
    never uploaded one). One that cannot be read or parsed fails the round:
    adopting without it could bring a purged session back."""
    name = purges_object(dead)
    if name not in names:
        return {}
    info = await bucket.get_info(name)
    if int(info.size or 0) > MAX_BYTES:
        raise PurgesFormatError(f"{name} is larger than {MAX_BYTES} bytes")
    try:
        return decode(bytes((await bucket.get(name)).data or b""))
    except PurgesFormatError as exc:
        log.error("fleet_adopt_purges_refused", host=dead, error=str(exc))
        raise


def unpurged_generations(gens: list[tuple[int, bytes]], ranges: Ranges, dead: str,
                         agent: str) -> list[tuple[int, bytes]]:
    """The generations no purge of the dead host covers (the others are never restored)."""
    kept = []
    for seq, raw in gens:
        if covered(ranges, f"agent/{agent}", seq):
            log.warning("fleet_generation_refused", host=dead, agent=agent, seq=seq,
                        reason="in a purged session")
        else:
            kept.append((seq, raw))
    return kept
