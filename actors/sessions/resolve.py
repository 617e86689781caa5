"""The one resolver of a session reference: an id, a unique prefix, or an agent.

A session whose purge has begun is refused (`SessionPurgingError`).
See docs/sessions.md ("Commands").
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from actors.sessions import index
from actors.sessions.ids import is_session_id
from broker.errors import CorralError

MIN_PREFIX = 4


class SessionRefError(CorralError):
    """The reference names no session, or more than one (the message says)."""


class SessionPurgingError(SessionRefError):
    """The session is being purged, or was."""


@dataclass(frozen=True)
class Resolved:
    session_id: str
    agent: str
    stream: str
    status: str  # open | paused | finished | closed
    first_seq: int
    last_seq: int


def resolve(root: Path, ref: str, conn: sqlite3.Connection | None = None) -> Resolved:
    own = conn is None
    db = index.open_index(root) if conn is None else conn
    try:
        return resolve_in(db, ref)
    finally:
        if own:
            db.close()


def resolve_in(conn: sqlite3.Connection, ref: str) -> Resolved:
    """`resolve` on an index already brought up to date."""
    if not ref or len(ref) > 128:
        raise SessionRefError("no session reference given")
    journal = index.journal_row(conn, ref) if is_session_id(ref) else None
    if journal is not None:
        raise SessionPurgingError(
            f"session {ref} is purged" if journal["state"] == "done" else
            f"session {ref} is being purged (step {journal['state']}): "
            f"`supervisor sessions purge {ref} --preview`, then retry the purge")
    row = conn.execute("SELECT * FROM sessions WHERE session_id=?", (ref,)).fetchone()
    if row is None:
        row = conn.execute("SELECT * FROM sessions WHERE agent=? ORDER BY first_seq DESC "
                           "LIMIT 1", (ref,)).fetchone()
    if row is None and len(ref) >= MIN_PREFIX and ref.isalnum():
        rows = conn.execute("SELECT * FROM sessions WHERE session_id LIKE ? LIMIT 2",
                            (ref.upper() + "%",)).fetchall()
        if len(rows) > 1:
            raise SessionRefError(f"{ref!r} is the start of more than one session id")
        row = rows[0] if rows else None
    if row is None:
        raise SessionRefError(f"no session {ref!r}")
    purging = index.journal_row(conn, str(row["session_id"]))
    if purging is not None:
        raise SessionPurgingError(f"session {row['session_id']} is being purged "
                                  f"(step {purging['state']})")
    return Resolved(str(row["session_id"]), str(row["agent"]), str(row["stream"]),
                    str(row["status"]), int(row["first_seq"]), int(row["last_seq"]))
