"""Session ids (ULID layout, Crockford base32) and where a session's files live.

See docs/sessions.md ("Ids").
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
SESSION_ID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")
SESSIONS_DIR = "sessions"  # .corral/sessions/<id>/: the files a session owns
STAGING_DIR = "purge-staging"  # .corral/purge-staging/<id>/: a purge under way
INDEX_FILE = "sessions.sqlite3"


_last = 0


def new_session_id(now_ms: int | None = None) -> str:
    """A new id; ids minted by one process increase strictly (within a
    millisecond the previous one plus one, as monotonic ULIDs do)."""
    global _last  # noqa: PLW0603 - the process's last id, for monotonicity
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    if value <= _last:
        value = _last + 1
    _last = value
    return "".join(_ALPHABET[(value >> shift) & 31] for shift in range(125, -1, -5))


def is_session_id(text: object) -> bool:
    return isinstance(text, str) and SESSION_ID.fullmatch(text) is not None


def session_dir(root: Path, session_id: str) -> Path:
    if not is_session_id(session_id):
        raise ValueError(f"not a session id: {session_id!r}")
    return root / SESSIONS_DIR / session_id


def staging_dir(root: Path, session_id: str) -> Path:
    if not is_session_id(session_id):
        raise ValueError(f"not a session id: {session_id!r}")
    return root / STAGING_DIR / session_id


def index_path(root: Path) -> Path:
    return root / INDEX_FILE
