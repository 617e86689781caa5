"""Adoption: the seqs an adopted record names, mapped to the adopter's seqs.

A reference that cannot be mapped refuses the agent's adoption
(`SeqReferenceError`). See docs/fleet.md ("Adoption of a rewound agent").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from actors.writer.client import encode_payload
from broker.errors import CorralError

REWIND = "rewind"
SAVED = "generation_saved"  # actors/kernel/generations.py SAVED_EVENT
_BRANCH = re.compile(r"^r(\d{1,19}):")
_GEN_KEY = re.compile(r"^g(\d{1,19}):(saved|adopted)$")


class SeqReferenceError(CorralError):
    """An imported record names a seq that is not an earlier adopted record."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _payload(record: Mapping[str, Any]) -> dict[str, Any]:
    payload = record.get("payload")
    return payload if isinstance(payload, dict) else {}


def references(record: Mapping[str, Any], rewinds: set[int]) -> list[int]:
    """The seqs of the agent's stream `record` names (payload and key);
    `rewinds`: the seqs of the adopted rewinds before it (branch tags).
    Raises SeqReferenceError for a malformed reference."""
    out: list[int] = []
    event = record.get("event")
    payload = _payload(record)
    if event == REWIND:
        for name in ("to_seq", "from_seq"):
            value = _int(payload.get(name))
            if value is None:
                raise SeqReferenceError(f"rewind at {record.get('seq')}: {name} "
                                        f"{payload.get(name)!r} is not a seq")
            out.append(value)
    elif event == SAVED:
        value = _int(payload.get("seq"))
        if value is None:
            raise SeqReferenceError(f"generation_saved at {record.get('seq')}: no seq")
        out.append(value)
    key = record.get("key")
    if isinstance(key, str) and (match := _BRANCH.match(key)) and int(match[1]) in rewinds:
        out.append(int(match[1]))
    return out


def check(records: Sequence[Mapping[str, Any]]) -> None:
    """Refuse the import unless every seq a record names is an earlier record's
    of the same list (the adopted ones, in order)."""
    seen: set[int] = set()
    rewinds: set[int] = set()
    last = 0
    for record in records:
        seq = _int(record.get("seq"))
        if seq is None or seq <= last:
            raise SeqReferenceError(f"record seq {record.get('seq')!r} out of order")
        for ref in references(record, rewinds):
            if ref not in seen:
                raise SeqReferenceError(
                    f"{record.get('event')} at {seq} names seq {ref}, not an earlier "
                    f"adopted record of the stream")
        seen.add(seq)
        last = seq
        if record.get("event") == REWIND:
            rewinds.add(seq)


def rewrite(record: Mapping[str, Any], seqs: Mapping[int, int],
            rewinds: set[int]) -> tuple[Any, str]:
    """(payload, key) of `record` with every seq it names mapped by `seqs`
    (old -> new of the records imported before it; `rewinds`: the old seqs of
    the rewinds among them; `check` passed). A record naming none comes back
    unchanged."""
    payload: Any = record.get("payload")
    key = str(record["key"])
    event = record.get("event")
    if event == REWIND and isinstance(payload, dict):
        old_from = payload["from_seq"]
        payload = {**payload, "to_seq": seqs[payload["to_seq"]], "from_seq": seqs[old_from]}
        if key.startswith("rewind:") and key.endswith(f":{old_from}"):
            key = f"{key[: -len(str(old_from))]}{seqs[old_from]}"
    elif event == SAVED and isinstance(payload, dict):
        old = payload["seq"]
        payload = {**payload, "seq": seqs[old]}
        if (match := _GEN_KEY.match(key)) and int(match[1]) == old:
            key = f"g{seqs[old]}:{match[2]}"
    if (match := _BRANCH.match(key)) and int(match[1]) in rewinds:
        key = f"r{seqs[int(match[1])]}:{key[match.end():]}"
    return payload, key


def renumber_branch(state: Any, seqs: Mapping[int, int], rewinds: set[int]) -> Any | None:
    """A generation's branch fields (`branch`, `last_rewind`) mapped to the new
    seqs when they come from an adopted rewind (`rewinds`: their old seqs);
    left as they are when they come from elsewhere (a fork's parent). None
    when a seq they name was not adopted."""
    match = _BRANCH.match(state.branch or "")
    if match and int(match[1]) in rewinds:
        state.branch = f"r{seqs[int(match[1])]}:"
    last = state.last_rewind
    if isinstance(last, dict) and _int(last.get("seq")) in rewinds:
        mapped = dict(last)
        for name in ("seq", "to_seq", "from_seq"):
            value = _int(last.get(name))
            if value is None or value not in seqs:
                return None
            mapped[name] = seqs[value]
        state.last_rewind = mapped
    return state


Item = tuple[str, bytes, str, Any]  # (event, payload, key, ledger): one append_many entry


def import_records(records: Sequence[Mapping[str, Any]], agent: str, chunk: int,
                   append: Callable[[str, list[Item]], int]) -> list[int]:
    """Append `records` (the dead host's, in order) through `append(origin,
    items) -> first new seq` (consecutive seqs for the items), in groups of at
    most `chunk` of one origin, each record's seq references rewritten to the
    new seqs; the new seq of each record, in order. `check` first: a bad
    reference appends nothing. A group ends before a record naming a seq whose
    new number is not known yet (a rewind, and the first record after one)."""
    check(records)
    mapping: dict[int, int] = {}  # the dead host's seq -> this host's
    rewinds: set[int] = set()
    seqs: list[int] = []
    group: list[Item] = []
    olds: list[int] = []
    origin = ""

    def flush() -> None:
        if group:
            first = append(origin, list(group))
            new = range(first, first + len(group))
            mapping.update(zip(olds, new, strict=True))
            seqs.extend(new)
            group.clear()
            olds.clear()

    for record in records:
        refs = references(record, rewinds)
        record_origin = str(record.get("origin") or agent)
        if record_origin != origin or len(group) >= chunk or \
                any(ref not in mapping for ref in refs):
            flush()
            origin = record_origin
        payload, key = rewrite(record, mapping, rewinds)
        group.append((str(record["event"]), encode_payload(payload), key,
                      record.get("ledger")))
        olds.append(int(record["seq"]))
        if record.get("event") == REWIND:
            rewinds.add(int(record["seq"]))
    flush()
    return seqs
