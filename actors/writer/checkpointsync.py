"""The writer's checkpoint, made durable by a thread off the writer's loop.

Order: fdatasync the ledgers, write and fsync the index entries, write the
checkpoint. Tests: `CORRAL_FAULT_CHECKPOINT_KILL_AT=index_synced:N` kills the
writer after the N-th such index sync. See docs/wal.md ("Start-up").
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.writer import checkpoint
from actors.writer.dedupe import pairs
from actors.writer.ledgers import Ledgers
from actors.writer.streamindex import Unsynced, write_unsynced

FAULT_ENV_CHECKPOINT_KILL_AT = "CORRAL_FAULT_CHECKPOINT_KILL_AT"


@dataclass
class Job:
    """One checkpoint: what to sync, then what to write."""

    ledgers: list[str]
    index: Unsynced
    index_dir: Path
    path: Path
    # the checkpoint's values (`dedupe`: a `DedupeWindows.snapshot()`), encoded in the thread
    fields: dict[str, Any]

    @property
    def head_seq(self) -> int:
        return int(self.fields["head_seq"])


@dataclass
class Outcome:
    job: Job
    stage: str = ""  # where it failed: ledger_sync, stream_index_write, checkpoint_write
    error: BaseException | None = None


class CheckpointThread:
    def __init__(self, ledgers: Ledgers) -> None:
        self.ledgers = ledgers
        self._thread: threading.Thread | None = None
        self._outcome: Outcome | None = None
        self._index_jobs = 0  # jobs that synced index files (fault injection)

    @property
    def busy(self) -> bool:
        """A job started and not yet collected."""
        return self._thread is not None

    def start(self, job: Job) -> None:
        assert self._thread is None, "one checkpoint at a time"
        self._outcome = None
        self._thread = threading.Thread(target=self._run, args=(job,), name="checkpoint",
                                        daemon=True)
        self._thread.start()

    def poll(self) -> Outcome | None:
        """The finished job's outcome, once (None while it runs or when none)."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def wait(self) -> Outcome | None:
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome, self._outcome = self._outcome, None
        return outcome

    def _run(self, job: Job) -> None:
        outcome = Outcome(job)
        try:
            outcome.stage = "ledger_sync"
            self.ledgers.sync_named(job.ledgers)
            if job.index.written:
                outcome.stage = "stream_index_write"
                write_unsynced(job.index_dir, job.index)
                self._index_jobs += 1
                _fault_point(f"index_synced:{self._index_jobs}")
            outcome.stage = "checkpoint_write"
            data = checkpoint.encode_fields({**job.fields,
                                             "dedupe": pairs(job.fields["dedupe"])})
            checkpoint.save_encoded(job.path, data)
            outcome.stage = ""
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which decides
            outcome.error = exc
        self._outcome = outcome


def _fault_point(step: str) -> None:
    if os.environ.get(FAULT_ENV_CHECKPOINT_KILL_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
