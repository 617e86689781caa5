"""`supervisor logs`: the per-actor JSON logs merged in time order, filtered.

Standard library only. See docs/operations.md ("Logs").
"""

from __future__ import annotations

import heapq
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50,
          "exception": 40}
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SKIP = ("timestamp", "level", "event", "actor", "pid")


@dataclass(frozen=True)
class Filter:
    actors: frozenset[str] = frozenset()
    min_level: int = 0
    since: str | None = None  # ISO UTC timestamp, compared as text

    def keep(self, record: dict[str, Any]) -> bool:
        if self.actors and record.get("actor") not in self.actors:
            return False
        if LEVELS.get(str(record.get("level", "info")).lower(), 20) < self.min_level:
            return False
        return not (self.since and sort_key(record) < self.since)


def sort_key(record: dict[str, Any]) -> str:
    """The record's UTC timestamp as comparable text (structlog drops a zero fraction)."""
    ts = str(record.get("timestamp", ""))
    return ts[:-1] + ".000000Z" if ts.endswith("Z") and "." not in ts else ts


def parse_since(text: str) -> str:
    """'90s', '5m', '2h', '1d' ago, or an ISO time; returns an ISO UTC string."""
    m = _RELATIVE.match(text.strip())
    if m:
        moment = datetime.now(UTC) - timedelta(seconds=float(m[1]) * _UNITS[m[2]])
    else:
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            raise ValueError(f"--since {text!r}: use 30s, 5m, 2h, 1d or an ISO time") from None
        if moment.tzinfo is None:
            moment = moment.astimezone()
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(line: str, actor: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    record.setdefault("actor", actor)
    return record


def _files(log_dir: Path, actor: str) -> list[Path]:
    current = log_dir / f"{actor}.log"
    rotated = sorted(
        (p for p in log_dir.glob(f"{actor}.log.*") if p.suffix[1:].isdigit()),
        key=lambda p: int(p.suffix[1:]), reverse=True,
    )
    return [*rotated, current]


def actors_in(log_dir: Path) -> list[str]:
    return sorted({p.name.split(".log")[0] for p in log_dir.glob("*.log*")
                   if re.fullmatch(r".+\.log(\.\d+)?", p.name)})


def _records(paths: list[Path], actor: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in paths:
        try:
            with path.open(encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    record = _parse(line, actor)
                    if record is not None:
                        yield sort_key(record), record
        except FileNotFoundError:
            continue


def merged(log_dir: Path, flt: Filter) -> Iterator[dict[str, Any]]:
    """Every kept record of every actor, in time order."""
    streams = [_records(_files(log_dir, a), a) for a in actors_in(log_dir)
               if not flt.actors or a in flt.actors]
    for _, record in heapq.merge(*streams, key=lambda item: item[0]):
        if flt.keep(record):
            yield record


def render(record: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(record, separators=(",", ":"))
    ts = str(record.get("timestamp", ""))
    extras = " ".join(f"{k}={record[k]}" for k in record if k not in _SKIP)
    return (f"{ts[:23]} {record.get('actor', '?'):<12} {record.get('level', '?'):<7} "
            f"{record.get('event', '')}  {extras}").rstrip()


class _Tail:
    """One actor's current log file, followed across rotation (inode change)."""

    def __init__(self, path: Path, from_end: bool) -> None:
        self.path = path
        self.fh: TextIO | None = None
        self.inode = -1
        self.buffer = ""
        self._open(from_end)

    def _open(self, at_end: bool) -> None:
        try:
            fh = self.path.open(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return
        self.fh = fh
        self.inode = os.fstat(fh.fileno()).st_ino
        if at_end:
            fh.seek(0, os.SEEK_END)

    def lines(self) -> list[str]:
        out: list[str] = []
        if self.fh is not None:
            out += self._drain()
        try:
            inode = self.path.stat().st_ino
        except FileNotFoundError:
            return out
        if inode != self.inode:  # rotated: finish the old file, start the new one
            if self.fh is not None:
                out += self._drain()
                self.fh.close()
                self.fh = None
            self._open(at_end=False)
            out += self._drain()
        return out

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None

    def _drain(self) -> list[str]:
        assert self.fh is not None
        self.buffer += self.fh.read()
        *complete, self.buffer = self.buffer.split("\n")
        return complete


def follow(log_dir: Path, flt: Filter, as_json: bool, out: TextIO = sys.stdout,
           interval_s: float = 0.2) -> None:
    """Print new records as they are written, until interrupted."""
    tails: dict[str, _Tail] = {a: _Tail(log_dir / f"{a}.log", from_end=True)
                               for a in actors_in(log_dir)}
    try:
        _follow(log_dir, flt, as_json, out, interval_s, tails=tails)
    finally:
        for tail in tails.values():
            tail.close()


def _follow(log_dir: Path, flt: Filter, as_json: bool, out: TextIO, interval_s: float, *,
            tails: dict[str, _Tail]) -> None:
    while True:
        for actor in actors_in(log_dir):
            if actor not in tails and (not flt.actors or actor in flt.actors):
                tails[actor] = _Tail(log_dir / f"{actor}.log", from_end=False)
        batch: list[tuple[str, dict[str, Any]]] = []
        for actor, tail in tails.items():
            if flt.actors and actor not in flt.actors:
                continue
            for line in tail.lines():
                record = _parse(line, actor)
                if record is not None and flt.keep(record):
                    batch.append((sort_key(record), record))
        for _, record in sorted(batch, key=lambda item: item[0]):
            out.write(render(record, as_json) + "\n")
        out.flush()
        time.sleep(interval_s)
