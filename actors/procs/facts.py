"""The WAL facts procs records on `procs/<session>` (origin `procs/<session>`).

Keys derive from the job and the request; command text and terminal input
are recorded as SHA-256 and sizes only. See docs/procs.md ("WAL facts").
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from typing import Any

from actors.writer.client import WriterClient
from broker.control import CallWatch


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stream_for(session: str) -> str:
    return f"procs/{session}"


class Facts:
    """Durable appends; `writer=None` records nothing (unit tests only)."""

    def __init__(self, writer: WriterClient | None, watch: CallWatch | None = None) -> None:
        self.writer = writer
        self.watch = watch  # the heartbeat goes on while an append waits for the writer
        self.appended = 0

    def record(self, session: str, event: str, key: str, **payload: Any) -> None:
        if self.writer is None:
            return
        stream = stream_for(session)
        deadline_s = self.writer.timeout_s * (self.writer.retries + 1)
        with self.watch.busy("append", deadline_s) if self.watch else nullcontext():
            self.writer.append(stream, event, payload, key=key, origin=stream)
        self.appended += 1
