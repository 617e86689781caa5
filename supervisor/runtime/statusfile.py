"""run/status.json: the last status the supervisor published.
Rewritten when a child's state changes, else every STATUS_REFRESH_S.

See docs/supervisor.md ("Status").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FORMAT = 1


def write(path: Path, status: dict[str, Any]) -> None:
    body = dict(status)
    body.pop("msg_id", None)
    body.pop("kind", None)
    body["format"] = FORMAT
    body["written_at"] = time.time()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        # dumps, not dump: json.dump encodes in Python chunk by chunk, dumps in C
        # (500 children: ~90 ms against a few, each status interval)
        fh.write(json.dumps(body, separators=(",", ":")))
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any] | None:
    """The last published status, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
