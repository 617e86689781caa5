"""The session index, `.corral/sessions.sqlite3`: derived tables and owned ones.

Every reader brings the derived part up to date from the WAL; a purged
session's records are never folded. See docs/sessions.md ("The index:
`.corral/sessions.sqlite3`").
"""

from __future__ import annotations

import json
import sqlite3
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.kernel.branch_events import BranchSwitchedError
from actors.kernel.fold import SESSION_STARTED, fold, fold_into
from actors.kernel.state import AgentState
from actors.sessions.ids import index_path, is_session_id
from actors.trees import branch
from actors.writer.wal import TornTail, WalRecord, iter_segment, list_segments
from broker.errors import WalCorruptionError

AGENT_PREFIX = "agent/"
FORK = "session_fork"  # a fork's first record: a new session (actors/trees/fork.py)
OPEN = ("new", "running")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions(
  session_id TEXT PRIMARY KEY, agent TEXT NOT NULL, stream TEXT NOT NULL,
  number INTEGER NOT NULL, parent_session TEXT, parent_agent TEXT, previous TEXT,
  created_at REAL NOT NULL, updated_at REAL NOT NULL,
  first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL,
  status TEXT NOT NULL, exit_reason TEXT, segments INTEGER NOT NULL,
  turns INTEGER NOT NULL, tool_calls INTEGER NOT NULL, events INTEGER NOT NULL,
  pending_input INTEGER NOT NULL, tokens INTEGER NOT NULL, fold TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_by_stream ON sessions(stream, first_seq);
CREATE TABLE IF NOT EXISTS segments(
  session_id TEXT NOT NULL, segment INTEGER NOT NULL, seq INTEGER NOT NULL,
  ts REAL NOT NULL, reason TEXT, PRIMARY KEY(session_id, seq));
CREATE TABLE IF NOT EXISTS streams(stream TEXT PRIMARY KEY, session_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS labels(
  session_id TEXT PRIMARY KEY, label TEXT NOT NULL, set_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS archive(session_id TEXT PRIMARY KEY, archived_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS purge_journal(
  session_id TEXT PRIMARY KEY, stream TEXT NOT NULL,
  first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL,
  state TEXT NOT NULL, started_at REAL, finished_at REAL);
"""
DERIVED = ("sessions", "segments", "streams", "meta")
SESSION_COLUMNS = (
    "session_id", "agent", "stream", "number", "parent_session", "parent_agent", "previous",
    "created_at", "updated_at", "first_seq", "last_seq", "status", "exit_reason", "segments",
    "turns", "tool_calls", "events", "pending_input", "tokens")


class SessionIndexError(Exception):
    """The index cannot be brought up to date (the message says why)."""


def connect(root: Path) -> sqlite3.Connection:
    """A connection to the index (created if missing), schema in place."""
    conn = sqlite3.connect(index_path(root), timeout=10.0, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(SCHEMA)
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def open_index(root: Path) -> sqlite3.Connection:
    """The index brought up to date with the WAL."""
    conn = connect(root)
    try:
        catch_up(conn, root)
    except BaseException:
        conn.close()
        raise
    return conn


# --- reading the WAL ---------------------------------------------------------------
def _crc(record: WalRecord) -> str:
    return f"{zlib.crc32(record.line):08x}"


def wal_records(root: Path, from_seq: int) -> Iterator[WalRecord]:
    """Records with seq >= from_seq straight from the segments, whole batches
    only (a batch still being written is left for the next call)."""
    segments = list_segments(root / "state" / "wal")
    start = [first for first, _ in segments if first <= from_seq]
    begin = start[-1] if start else (segments[0][0] if segments else 0)
    pending: list[WalRecord] = []
    for first, path in segments:
        if first < begin:
            continue
        try:
            for _, record in iter_segment(path):
                if isinstance(record, TornTail):
                    return
                if record.seq < from_seq:
                    continue
                pending.append(record)
                if record.seq >= record.batch_last:
                    yield from pending
                    pending = []
        except WalCorruptionError as exc:
            raise SessionIndexError(
                f"the WAL is damaged ({exc}): see `supervisor wal verify`") from exc
        except FileNotFoundError:
            return


def _record_at(root: Path, seq: int) -> WalRecord | None:
    for record in wal_records(root, seq):
        return record if record.seq == seq else None
    return None


# --- the derived part ----------------------------------------------------------------
def _meta(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return None if row is None else str(row[0])


def _purged_ids(conn: sqlite3.Connection) -> set[str]:
    return {str(r[0]) for r in conn.execute("SELECT session_id FROM purge_journal")}


def _status(state: AgentState) -> str:
    return "open" if state.phase in OPEN else state.phase


def clear_derived(conn: sqlite3.Connection) -> None:
    for table in DERIVED:
        conn.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed table names


def catch_up(conn: sqlite3.Connection, root: Path) -> int:
    """Fold the WAL's records after `meta.last_seq` into the derived tables;
    returns how many records were read."""
    with transaction(conn):
        last = int(_meta(conn, "last_seq") or 0)
        if last:
            record = _record_at(root, last)
            segments = list_segments(root / "state" / "wal")
            if record is None and segments and segments[0][0] > last:
                pass  # compacted away (docs/storage.md), not lost: what we folded stands
            elif record is None or _crc(record) != _meta(conn, "last_crc"):
                clear_derived(conn)  # the WAL is not the one we read: start again
                last = 0
        return _fold_wal(conn, root, last + 1)


def reindex(root: Path) -> sqlite3.Connection:
    """Rebuild every derived table from the first record of the WAL."""
    conn = connect(root)
    with transaction(conn):
        clear_derived(conn)
        _fold_wal(conn, root, 1)
    return conn


@dataclass
class _Live:
    state: AgentState
    row: dict[str, Any]
    segments: list[tuple[int, int, float, str | None]]


def _refold(root: Path, stream: str, first_seq: int, last_seq: int) -> AgentState:
    """The session's state from its first record to `last_seq`, on its active
    branch (actors/trees/branch.py)."""
    events = []
    for record in wal_records(root, first_seq):
        if record.seq > last_seq:
            break
        if record.stream == stream:
            try:
                events.append((record.seq, record.event, record.payload()))
            except ValueError:
                continue
    return fold(AgentState(), branch.active(events))


def _fold_wal(conn: sqlite3.Connection, root: Path, from_seq: int) -> int:
    purged = _purged_ids(conn)
    current = {str(r[0]): str(r[1]) for r in conn.execute("SELECT stream, session_id FROM streams")}
    live: dict[str, _Live] = {}
    count = 0
    last: WalRecord | None = None

    def load(session_id: str) -> _Live | None:
        if session_id in live:
            return live[session_id]
        row = conn.execute("SELECT * FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        if row is None:
            return None
        item = _Live(AgentState.model_validate_json(row["fold"]),
                     {k: row[k] for k in SESSION_COLUMNS}, [])
        live[session_id] = item
        return item

    for record in wal_records(root, from_seq):
        count += 1
        last = record
        stream = record.stream
        if not stream.startswith(AGENT_PREFIX):
            continue
        try:
            payload = record.payload()
        except ValueError:
            continue
        if record.event in (SESSION_STARTED, FORK):
            sid = payload.get("session") if isinstance(payload, dict) else None
            known = load(str(sid)) if is_session_id(sid) else None
            if not is_session_id(sid) or sid in purged or known is not None:
                # malformed, purged, or a second start of a known id: what follows
                # belongs to that session only if it is this stream's own
                own = known is not None and known.row["stream"] == stream
                current[stream] = str(sid) if own or sid in purged else ""
                continue
            assert isinstance(payload, dict)
            assert isinstance(sid, str)
            state = fold(AgentState(), [(record.seq, record.event, payload)])
            parent_agent = state.parent_agent
            parent = current.get(f"{AGENT_PREFIX}{parent_agent}") if parent_agent else None
            if record.event == FORK:  # a fork names its parent session itself
                named = payload.get("parent_session")
                parent = named if is_session_id(named) else parent
            live[sid] = _Live(state, {
                "session_id": sid, "agent": stream.removeprefix(AGENT_PREFIX),
                "stream": stream, "number": state.session_no,
                "parent_session": parent or None, "parent_agent": parent_agent,
                "previous": payload.get("previous") if is_session_id(
                    payload.get("previous")) else None,
                "created_at": record.ts, "first_seq": record.seq}, [])
            current[stream] = sid
        else:
            sid = current.get(stream, "")
            if not sid or sid in purged:
                continue  # before any session, or the records of a purged one
            item = load(sid)
            if item is None:
                continue
            try:
                fold_into(item.state, [(record.seq, record.event, payload)])  # ours: no copy
            except BranchSwitchedError:  # a rewind: fold the session's active branch again
                item.state = _refold(root, stream, int(item.row["first_seq"]), record.seq)
            if record.event == "session_start":
                reason = payload.get("reason") if isinstance(payload, dict) else None
                item.segments.append((item.state.segment, record.seq, record.ts,
                                      reason if isinstance(reason, str) else None))
        item = live[sid]
        item.row.update(last_seq=record.seq, updated_at=record.ts)
    for sid, item in live.items():
        s = item.state
        item.row.update(
            status=_status(s), exit_reason=s.exit_reason, segments=s.segment, turns=s.turn,
            tool_calls=s.counts.tool_calls, events=s.counts.events,
            pending_input=len(s.pending_approvals()) + (1 if s.phase == "paused" else 0),
            tokens=s.budget.tokens_used)
        values = [item.row.get(c) for c in SESSION_COLUMNS]
        conn.execute(
            f"INSERT OR REPLACE INTO sessions({', '.join(SESSION_COLUMNS)}, fold) "
            f"VALUES({', '.join('?' * (len(SESSION_COLUMNS) + 1))})",
            [*values, s.model_dump_json()])
        conn.executemany("INSERT OR REPLACE INTO segments VALUES(?,?,?,?,?)",
                         [(sid, *seg) for seg in item.segments])
    conn.executemany("INSERT OR REPLACE INTO streams VALUES(?,?)",
                     [(k, v) for k, v in current.items() if v])
    if last is not None:
        conn.execute("INSERT OR REPLACE INTO meta VALUES('last_seq', ?)", (str(last.seq),))
        conn.execute("INSERT OR REPLACE INTO meta VALUES('last_crc', ?)", (_crc(last),))
    return count


# --- queries -----------------------------------------------------------------------------
def session_row(conn: sqlite3.Connection, session_id: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT s.*, l.label, a.archived_at FROM sessions s "
        "LEFT JOIN labels l USING(session_id) LEFT JOIN archive a USING(session_id) "
        "WHERE s.session_id=?", (session_id,)).fetchone()
    return None if row is None else _public(row)


def _public(row: sqlite3.Row) -> dict[str, Any]:
    out = {k: row[k] for k in row.keys() if k != "fold"}  # noqa: SIM118 - sqlite3.Row
    out["archived"] = out.get("archived_at") is not None
    return out


def list_sessions(conn: sqlite3.Connection, *, include_archived: bool = False,
                  label: str | None = None, agent: str | None = None) -> list[dict[str, Any]]:
    query = ("SELECT s.*, l.label, a.archived_at FROM sessions s "
             "LEFT JOIN labels l USING(session_id) LEFT JOIN archive a USING(session_id) "
             "WHERE s.session_id NOT IN (SELECT session_id FROM purge_journal)")
    args: list[Any] = []
    if not include_archived:
        query += " AND a.archived_at IS NULL"
    if label is not None:
        query += " AND l.label=?"
        args.append(label)
    if agent is not None:
        query += " AND s.agent=?"
        args.append(agent)
    query += " ORDER BY s.session_id"
    return [_public(r) for r in conn.execute(query, args)]


def segments_of(conn: sqlite3.Connection, session_id: str) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(
        "SELECT segment, seq, ts, reason FROM segments WHERE session_id=? ORDER BY seq",
        (session_id,))]


def derived_snapshot(conn: sqlite3.Connection) -> dict[str, Any]:
    """Every derived row (for comparing a live index with a rebuilt one)."""
    return {
        "sessions": [dict(r) for r in conn.execute("SELECT * FROM sessions ORDER BY session_id")],
        "segments": [dict(r) for r in conn.execute(
            "SELECT * FROM segments ORDER BY session_id, seq")],
        "streams": [dict(r) for r in conn.execute("SELECT * FROM streams ORDER BY stream")],
    }


# --- the owned part ------------------------------------------------------------------------
def set_label(conn: sqlite3.Connection, session_id: str, label: str) -> None:
    with transaction(conn):
        conn.execute("INSERT OR REPLACE INTO labels VALUES(?,?,?)",
                     (session_id, label, time.time()))


def set_archived(conn: sqlite3.Connection, session_id: str, archived: bool) -> bool:
    """Archive or unarchive; False when it already was so."""
    with transaction(conn):
        known = conn.execute("SELECT 1 FROM archive WHERE session_id=?",
                             (session_id,)).fetchone() is not None
        if known == archived:
            return False
        if archived:
            conn.execute("INSERT INTO archive VALUES(?,?)", (session_id, time.time()))
        else:
            conn.execute("DELETE FROM archive WHERE session_id=?", (session_id,))
    return True


def journal_row(conn: sqlite3.Connection, session_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT * FROM purge_journal WHERE session_id=?",
                       (session_id,)).fetchone()
    return None if row is None else dict(row)


def dumps(rows: Any) -> str:
    return json.dumps(rows, sort_keys=True)
