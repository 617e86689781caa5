"""The WAL facts procs records, through the writer, on the stream
`procs/<session>`, with the origin `procs/<session>` too: the writer keeps
idempotency keys per origin for a bounded window (the last 256), so each
session gets a window of its own and a fact replayed for one agent (a call
run again after its crash) is not pushed out of it by every other agent's
facts. Each carries an idempotency key derived from the job and the
request, so a retried or replayed fact is written once.

    proc_start      proc_id, pid, command_sha256, command_bytes, cwd, cap_bytes,
                    lifetime_s, foreground
    proc_poll       proc_id, cursor, next_cursor, data_sha256, state, exit_code
                    (only polls that return bytes or the end: what entered context)
    proc_exit       proc_id, state, exit_code, log_bytes
    proc_kill       proc_id, reason
    proc_reattached proc_id, pid                 (after a procs restart)
    proc_lost       proc_id, kind, reason         (after a procs restart)
    terminal_start  proc_id, pid, argv_sha256, argv_bytes, cwd, cap_bytes, lifetime_s
    terminal_input  proc_id, data_sha256, data_bytes   (never the text)
    terminal_read   proc_id, cursor, next_cursor, data_sha256, state
    terminal_end    proc_id, state, exit_code, log_bytes, reason
    session_end     ended

Command text and terminal input are recorded as SHA-256 and sizes only.
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
