"""Context compaction: a long session keeps its thread within the model's window.

Owns the order summary file -> `compaction_recorded` -> `compaction_boundary`
and the recovery between them. See docs/operator-input.md
("Context compaction").
"""

from __future__ import annotations

import json
import os
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.kernel.state import AgentState, Compaction

FILE_NAME = "compactions.jsonl"
CHARS_PER_TOKEN = 4
SYSTEM_TOKENS = 200  # the system message and the task prompt, as budgeted
MAX_READ_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Summary:
    text: str
    method: str  # "scripted" | "model:<name>"
    tokens_in: int = 0
    tokens_out: int = 0


def tokens_of(value: Any) -> int:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                          default=str)
    return len(text) // CHARS_PER_TOKEN + 1


class _ItemSizes:
    """The sum of `tokens_of` over the exchanges of `recent`, kept as the
    list changes: amortized O(exchanges added), not O(history) per turn.

    The context's size is asked for before every model request. The fold
    changes `recent` in two ways only: it appends a new exchange dict, and
    it deletes the oldest ones (the window's bound, a compaction boundary);
    an exchange is never changed in place. So the sizes are mirrored here
    in the list's order: the oldest dropped until the mirror starts where the
    list does, then the new exchanges sized and added. Anything else (another
    list, as a rebuild or a generation gives, or a list whose kept part does
    not line up with the mirror) is summed again from the start. Objects
    are held, so no identity compared here is reused while mirrored."""

    def __init__(self) -> None:
        self._items: list[Any] | None = None  # the list the mirror follows
        self._mirror: deque[tuple[Any, int]] = deque()  # (exchange, its tokens)
        self._total = 0

    def total(self, items: Sequence[Any]) -> int:
        mirror = self._mirror
        if items is not self._items or not mirror or not items:
            return self._again(items)
        first = items[0]
        while mirror and mirror[0][0] is not first:
            self._total -= mirror.popleft()[1]
        kept = len(mirror)
        if not kept or kept > len(items) or items[kept - 1] is not mirror[-1][0]:
            return self._again(items)
        for item in items[kept:]:
            self._add(item)
        return self._total

    def _again(self, items: Sequence[Any]) -> int:
        self._items = items if isinstance(items, list) else None
        self._mirror = deque()
        self._total = 0
        for item in items:
            self._add(item)
        return self._total

    def _add(self, item: Any) -> None:
        size = tokens_of(item)
        self._mirror.append((item, size))
        self._total += size


_sizes = _ItemSizes()


def context_tokens(state: AgentState) -> int:
    """The estimated size of the next request's context: system, summary,
    exchanges, and the operator inputs consumed for it."""
    summary = state.summary.tokens if state.summary is not None else 0
    inputs = sum(i.chars // CHARS_PER_TOKEN + 1 for i in state.inputs
                 if i.consumed_turn is not None)
    return SYSTEM_TOKENS + summary + inputs + _sizes.total(state.recent)


def plan(state: AgentState, window: int, keep_share: float) -> int:
    """How many of the oldest exchanges to replace: the newest ones that fit in
    `keep_share` of the window are kept (at least one is replaced)."""
    budget = int(window * keep_share)
    kept, size = 0, 0
    for item in reversed(state.recent):
        size += tokens_of(item)
        if size > budget:
            break
        kept += 1
    return max(1, len(state.recent) - kept)


def due(state: AgentState, window: int | None, trigger_share: float, recent_max: int) -> bool:
    if window is None or not state.recent:
        return False
    return (context_tokens(state) > window * trigger_share
            or len(state.recent) >= recent_max * 3 // 4)


def scripted_summary(previous: str | None, items: Sequence[dict[str, Any]], limit: int) -> str:
    """A deterministic summary (scripted and replay models): the range, the ops
    and their outcomes, the newest texts; the previous summary's head folded in."""
    turns = [int(i.get("turn", 0)) for i in items]
    ops = Counter(str((i.get("action") or {}).get("op", i.get("input", "text")))
                  if isinstance(i.get("action") or {}, dict) else "invalid" for i in items)
    statuses = Counter(str(i.get("status", "-")) for i in items)
    lines = [f"Turns {min(turns)}-{max(turns)}: {len(items)} exchanges; ops "
             + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items()))
             + "; outcomes " + ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))]
    for item in items[-3:]:
        if "text" in item:
            lines.append(f"said at turn {item.get('turn')}: {str(item['text'])[:200]}")
    if previous:
        lines.append("Before that: " + previous[: limit // 2])
    return "\n".join(lines)[:limit]


# --- the compaction file ----------------------------------------------------------
def path_of(agent_dir: Path) -> Path:
    return agent_dir / FILE_NAME


def append_record(agent_dir: Path, record: dict[str, Any]) -> None:
    """One line, fsynced (and its directory on creation), before the WAL names it."""
    agent_dir.mkdir(parents=True, exist_ok=True)
    path = path_of(agent_dir)
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
                 + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        from broker.durable import fsync_dir  # noqa: PLC0415

        fsync_dir(agent_dir)


def read_record(agent_dir: Path, ref: Compaction) -> dict[str, Any] | None:
    """The file's line `ref` names (its id and its summary's hash), if it holds one."""
    import hashlib  # noqa: PLC0415

    try:
        fd = os.open(path_of(agent_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_READ_BYTES)
    for line in reversed(data.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if not isinstance(record, dict) or record.get("compaction") != ref.compaction:
            continue
        text = record.get("summary")
        if isinstance(text, str) and hashlib.sha256(text.encode()).hexdigest() == ref.sha256:
            return record
    return None


def read_summary(agent_dir: Path, ref: Compaction) -> str | None:
    """The summary `ref` names, if the file holds a line with its id and hash."""
    record = read_record(agent_dir, ref)
    return None if record is None else str(record["summary"])


def copy_for(state: AgentState, source_dir: Path, target_dir: Path) -> int:
    """Copy into `target_dir`'s file the lines `state` names (its summary in
    effect and a pending one) from `source_dir`'s: a fork's context needs its
    parent's summaries (actors/trees/fork.py). Returns how many were copied."""
    copied = 0
    for ref in (state.summary, state.compaction_pending):
        record = None if ref is None else read_record(source_dir, ref)
        if record is not None:
            append_record(target_dir, record)
            copied += 1
    return copied


class SummaryCache:
    """Summaries by compaction id, read from the file once per process."""

    def __init__(self, agent_dir: Path) -> None:
        self.agent_dir = agent_dir
        self.texts: dict[str, str] = {}

    def get(self, ref: Compaction | None) -> str | None:
        if ref is None:
            return None
        key = f"{ref.compaction}:{ref.sha256}"
        if key not in self.texts:
            text = read_summary(self.agent_dir, ref)
            if text is None:
                return f"[summary {ref.compaction} unavailable: the compaction file lost it]"
            self.texts[key] = text
        return self.texts[key]


# --- the loop's step ----------------------------------------------------------------
def summarize(backend: Any, busy: Any, previous: str | None, items: list[dict[str, Any]],
              limit: int) -> Summary:
    """The backend's summary when it makes one (a model call, declared through
    `busy()` so heartbeats go on), else the deterministic scripted one."""
    make = getattr(backend, "summarize", None)
    if callable(make):
        with busy():
            made = make(previous, items, limit)
        if isinstance(made, Summary):
            return made
    return Summary(scripted_summary(previous, items, limit), "scripted")


def advance(state: AgentState, settings: Any, *, summaries: SummaryCache, backend: Any,
            append: Any, flush: Any, hit: Any, recent_max: int, busy: Any = None) -> bool:
    """One compaction step before a model request; False when there is none to do.
    `append(event, payload, key, ledger)` is the loop's append (folded at once,
    durable at `flush()`); `busy()` declares the summary's model call. The record
    is flushed before the boundary is appended: a crash between them leaves the
    record alone, which changes nothing until its boundary."""
    agent_dir = summaries.agent_dir
    pending = state.compaction_pending
    if pending is not None:  # recorded before a crash: finish that very compaction
        if read_summary(agent_dir, pending) is None:
            append("compaction_abandoned", {"compaction": pending.compaction,
                                            "reason": "summary unreadable"},
                   f"{pending.compaction}:abandoned", None)
        else:
            append("compaction_boundary", {"compaction": pending.compaction},
                   f"{pending.compaction}:boundary", None)
        return True
    if not due(state, settings.window_tokens, settings.trigger_share, recent_max):
        return False
    count = plan(state, settings.window_tokens, settings.keep_share)
    items = state.recent[:count]
    from contextlib import nullcontext  # noqa: PLC0415

    summary = summarize(backend, busy or nullcontext, summaries.get(state.summary), items,
                        settings.summary_chars)
    text = summary.text[: settings.summary_chars]
    ident = f"m{state.compactions + 1}"
    import hashlib  # noqa: PLC0415

    sha = hashlib.sha256(text.encode()).hexdigest()
    before = context_tokens(state)
    replaced = sum(tokens_of(i) for i in items) + (state.summary.tokens if state.summary else 0)
    record = {
        "compaction": ident, "method": summary.method, "items": count,
        "from_turn": int(items[0].get("turn", 0)), "through_turn": int(items[-1].get("turn", 0)),
        "previous": state.summary.compaction if state.summary else None,
        "tokens_before": before, "tokens_after": before - replaced + tokens_of(text),
        "sha256": sha, "chars": len(text), "summary_tokens": tokens_of(text),
        "usage": {"tokens_in": summary.tokens_in, "tokens_out": summary.tokens_out,
                  "cost_units": round((summary.tokens_in + summary.tokens_out) / 1000, 6)},
    }
    append_record(agent_dir, {**record, "summary": text})
    append("compaction_recorded", {**record, "file": FILE_NAME}, f"{ident}:record", "budget")
    flush()
    hit("after_compaction_recorded", ident)
    append("compaction_boundary", {"compaction": ident}, f"{ident}:boundary", None)
    return True


# --- bounding the file ---------------------------------------------------------------
PRUNE_OVER_BYTES = 64 * 1024  # below this the file is left as it is
PRUNE_GROWTH = 2  # the next pass when the file has grown to this times its size after one


def refs_of(state: AgentState) -> set[tuple[str, str]]:
    """The (compaction id, sha256) pairs a state names."""
    return {(ref.compaction, ref.sha256) for ref in (state.summary, state.compaction_pending)
            if ref is not None}


def named_by(event: str, payload: Any) -> set[tuple[str, str]]:
    """The lines a stream record names: a `compaction_recorded` fact its own, a
    fork's first record those of the state it carries."""
    if not isinstance(payload, dict):
        return set()
    if event == "compaction_recorded":
        ident, sha = payload.get("compaction"), payload.get("sha256")
        return {(ident, sha)} if isinstance(ident, str) and isinstance(sha, str) else set()
    if event == "session_fork" and isinstance(payload.get("state"), dict):
        found: set[tuple[str, str]] = set()
        for field in ("summary", "compaction_pending"):
            ref = payload["state"].get(field)
            if isinstance(ref, dict) and isinstance(ref.get("compaction"), str) \
                    and isinstance(ref.get("sha256"), str):
                found.add((ref["compaction"], ref["sha256"]))
        return found
    return set()


def prune(agent_dir: Path, keep: set[tuple[str, str]]) -> int:
    """Rewrite the file with only the lines `keep` names (temp file, fsync,
    rename, directory fsync: a crash leaves the old file or the new one);
    returns how many lines went. The caller's `keep` is every line something
    still readable names: the records left in the agent's stream, its kept
    generations, its state now (docs/storage.md, "The compaction file")."""
    path = path_of(agent_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_READ_BYTES)
    kept: list[bytes] = []
    dropped = 0
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1  # a torn line: names nothing
            continue
        if isinstance(record, dict) and (record.get("compaction"), record.get("sha256")) in keep:
            kept.append(line)
        else:
            dropped += 1
    if not dropped:
        return 0
    from broker.durable import write_atomic  # noqa: PLC0415

    write_atomic(path, b"".join(line + b"\n" for line in kept))
    return dropped
