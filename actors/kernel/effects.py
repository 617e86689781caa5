"""The effect journal: a write is applied at most once even if the WAL lost it.

Owns `.corral/agents/<name>/effects/journal@<session>.jsonl` (not fsynced;
derived and local); the earlier layout, a file per entry
(`<call_id>@<session>.json`), is still read and pruned. See docs/agents.md
("Recovery") and docs/decisions.md ("Only what nothing else holds is
fsynced").
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from broker import compactjson
from broker.durable import open_append, read_regular

KEEP_TURNS = 64


@dataclass(frozen=True)
class Entry:
    call_id: str
    action_sha: str
    label: str
    before_sha: str | None
    after_sha: str | None
    result: dict[str, Any]


def action_digest(action: Any) -> str:
    text = json.dumps(action, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _line(entry: Entry) -> bytes:
    """One journal line: compact JSON on orjson, as json wrote it but for
    non-ASCII text (UTF-8, not escaped: both read back alike) and a NaN
    (null: a write's result is the op's own dict of names and counts, never
    one); what orjson declines (a lone surrogate, an integer past 64 bits)
    as json writes it, as every line was before."""
    try:
        return orjson.dumps(entry.__dict__, option=compactjson.PASSTHROUGH) + b"\n"
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(entry.__dict__, separators=(",", ":")).encode() + b"\n"


def file_name(call_id: str, session: str | None) -> str:
    return f"{call_id}.json" if session is None else f"{call_id}@{session}.json"


def session_of_file(name: str) -> str | None:
    """The session an entry's file name carries (None: written before sessions):
    a session's journal (`journal@<session>.jsonl`), an entry file of the
    earlier layout (`<call_id>@<session>.json`), or either's temporary file."""
    stem = name.removesuffix(".tmp").removesuffix(".jsonl").removesuffix(".json")
    return stem.partition("@")[2] or None


def journal_name(session: str | None) -> str:
    return "journal.jsonl" if session is None else f"journal@{session}.jsonl"


def _turn_of(call_id: str) -> int | None:
    head = call_id.split(".", 1)[0]
    return int(head) if head.isdigit() else None


PRUNE_EVERY = 8  # turns between two prunes in one session (a listing each)
REWRITE_OVER = 2  # a session's journal is rewritten when it holds this many times its live lines


class EffectJournal:
    """One session's entries at a time, in memory and in its journal: `get`
    reads memory, `record` appends one line through an fd kept open (a line
    a crash tore does not parse and is skipped, as a temporary file never
    renamed was; the next append starts on a line of its own)."""

    def __init__(self, agent_dir: Path) -> None:
        self.dir = agent_dir / "effects"
        self._pruned: tuple[int, str | None] | None = None  # (turn, session) of the last prune
        self._session: str | None = None
        self._loaded = False  # `_entries` holds `_session`'s journal
        self._entries: dict[str, Entry] = {}
        self._lines = 0  # lines in the journal file, live or not
        self._fd = -1  # the journal's, for appends (-1: not open)
        self._closer: weakref.finalize[Any, Any] | None = None  # closes it with this journal
        self._torn = False  # the file does not end with a newline

    def get(self, call_id: str, session: str | None) -> Entry | None:
        self._load(session)
        return self._entries.get(call_id)

    def record(self, entry: Entry, session: str | None) -> None:
        self._load(session)
        line = _line(entry)
        try:
            self._append(line)
        except FileNotFoundError:  # the directory went away under us: make it again
            self._close()
            self._append(line)
        self._entries[entry.call_id] = entry
        self._lines += 1

    def _append(self, line: bytes) -> None:
        if self._fd < 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = open_append(self.dir / journal_name(self._session))
            self._closer = weakref.finalize(self, os.close, self._fd)
        if self._torn:  # a crash cut the last line: this one starts on its own
            line = b"\n" + line
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:  # a full disk: a part written is a torn line
            self._torn = self._torn or len(view) < len(line)
            raise
        self._torn = False  # durable as the page cache is (module docstring)

    def _close(self) -> None:
        closer, self._closer, self._fd = self._closer, None, -1
        if closer is not None:
            closer()  # closes the fd

    def _load(self, session: str | None) -> None:
        """Read `session`'s entries once (its journal, then any entry file of
        the earlier layout, which a restart after an upgrade may find)."""
        if self._loaded and self._session == session:
            return
        self._close()
        self._session, self._loaded = session, True
        self._entries, self._lines, self._torn = {}, 0, False
        data = read_regular(self.dir / journal_name(session)) or b""  # never through a link
        self._torn = bool(data) and not data.endswith(b"\n")
        for line in data.splitlines():
            self._lines += 1
            entry = _parse(line)
            if entry is not None:
                self._entries[entry.call_id] = entry
        try:
            names = os.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            if name.endswith(".json") and session_of_file(name) == session:
                try:
                    entry = _parse(read_regular(self.dir / name) or b"")
                except OSError:
                    continue
                if entry is not None:
                    self._entries.setdefault(entry.call_id, entry)

    def prune(self, turn: int, session: str | None) -> None:
        """Drop entries of turns older than `turn - KEEP_TURNS`, and other
        sessions' files (never matched again: a session begins after the
        previous one is over). Every `PRUNE_EVERY` turns within a session:
        the directory is listed, and the journal rewritten (temp, rename)
        once it holds `REWRITE_OVER` times its live lines."""
        last = self._pruned
        if last is not None and last[1] == session and 0 <= turn - last[0] < PRUNE_EVERY:
            return
        self._pruned = (turn, session)
        self._load(session)
        for call_id in [c for c in self._entries
                        if (t := _turn_of(c)) is not None and t < turn - KEEP_TURNS]:
            del self._entries[call_id]
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return
        mine = journal_name(session)
        for name in names:
            t = None if name.startswith("journal") else _turn_of(name)  # an entry file
            if (name != mine and session_of_file(name) != session) or (
                    t is not None and t < turn - KEEP_TURNS):
                (self.dir / name).unlink(missing_ok=True)
        if self._lines > REWRITE_OVER * max(len(self._entries), 8):
            self._rewrite()

    def _rewrite(self) -> None:
        data = b"".join(_line(e) for e in self._entries.values())
        name = journal_name(self._session)
        tmp = self.dir / f"{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / name)  # whole or absent; durable as the page cache is
        self._close()  # it names the file replaced
        self._lines, self._torn = len(self._entries), False


def _parse(line: bytes) -> Entry | None:
    try:
        data = json.loads(line)
        return Entry(**data) if isinstance(data, dict) else None
    except (ValueError, TypeError):
        return None
