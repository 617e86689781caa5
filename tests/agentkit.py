"""Helpers for agent tests: an in-memory stand-in for the writer (same
append/read_stream contract: global gapless seq, idempotency by (origin, key))
and task/spec builders."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from actors.kernel.settings import AgentSettings, AgentSpec, Permissions, Rule
from actors.writer.payload import check_payload
from broker import protocol


@dataclass(frozen=True)
class FakeRecord:
    seq: int
    stream: str
    event: str
    body: bytes
    ledger: str | None
    key: str = ""

    def payload(self) -> object:
        return json.loads(self.body)


class FakeWriter:
    def __init__(self) -> None:
        self.records: list[FakeRecord] = []
        self.keys: dict[tuple[str, str], int] = {}
        self.origin = "test"
        self.many_calls = 0

    def as_origin(self, origin: str) -> FakeWriter:
        view = FakeWriter.__new__(FakeWriter)
        view.records, view.keys, view.origin = self.records, self.keys, origin
        view.many_calls = 0
        return view

    def append(self, stream: str, event: str, payload: Any, *, key: str,
               ledger: str | None = None, origin: str | None = None) -> protocol.AppendOk:
        if origin is not None and origin != self.origin:
            return self.as_origin(origin).append(stream, event, payload, key=key, ledger=ledger)
        known = self.keys.get((self.origin, key))
        if known is not None:
            return protocol.AppendOk(msg_id="m", seq=known, duplicate=True)
        body = (payload if isinstance(payload, bytes)  # already encoded, as WriterClient takes
                else json.dumps(payload, separators=(",", ":")).encode())
        check_payload(body)  # the real writer's JSON policy: refused as it would be
        seq = len(self.records) + 1
        self.records.append(FakeRecord(seq, stream, event, body, ledger, key))
        self.keys[(self.origin, key)] = seq
        return protocol.AppendOk(msg_id="m", seq=seq, duplicate=False)

    def append_many(self, stream: str, records: list[tuple[str, bytes, str, str | None]],
                    *, origin: str | None = None) -> protocol.AppendManyOk:
        """The writer's multi-record append: consecutive seqs, all keys new or
        all written (answered as a duplicate with the first seq)."""
        self.many_calls += 1
        who = origin or self.origin
        known = [self.keys.get((who, key)) for _, _, key, _ in records]
        if all(seq is not None for seq in known):
            return protocol.AppendManyOk(msg_id="m", seq=known[0], count=len(records),
                                         prev_seq=None, duplicate=True)
        assert not any(seq is not None for seq in known), "keys partly written"
        prev = max((r.seq for r in self.records if r.stream == stream), default=0)
        first = len(self.records) + 1
        for i, (event, body, key, ledger) in enumerate(records):
            self.records.append(FakeRecord(first + i, stream, event, body, ledger, key))
            self.keys[(who, key)] = first + i
        return protocol.AppendManyOk(msg_id="m", seq=first, count=len(records), prev_seq=prev,
                                     duplicate=False)

    def read_stream(self, stream: str, from_seq: int = 1, page: int = 512) -> Iterator[FakeRecord]:
        return iter([r for r in self.records if r.stream == stream and r.seq >= from_seq])

    def events(self, stream: str) -> list[tuple[str, Any]]:
        return [(r.event, r.payload()) for r in self.records if r.stream == stream]

    def close(self) -> None:
        pass


def write_task(path: Path, steps: list[dict[str, Any]], **extra: Any) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "steps": steps, **extra}))
    return path


def spec(task: Path, *, rules: list[Rule] | None = None, **settings: Any) -> AgentSpec:
    return AgentSpec(task=str(task), settings=AgentSettings(
        permissions=Permissions(rules=rules or []), **settings))


def tree(root: Path) -> dict[str, str]:
    """Every file under root (relative path -> text), temp files excluded."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".corral-tmp")}
