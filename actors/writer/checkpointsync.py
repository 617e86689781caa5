"""The writer's checkpoint, made durable off its loop (docs/wal.md).

A checkpoint may name only durable state: the ledgers' sizes (fdatasynced)
and the stream index's counts (the files fsynced, their directory too when a
file was created). Those syncs took the writer's loop for tens of milliseconds
per checkpoint, so no acknowledgement left meanwhile. Now the loop only takes
the snapshot (the checkpoint's values, the ledgers written since the last
sync, the index entries taken from memory by `StreamIndex.take_pending`:
appending them to 64 files took the loop 1-27 ms of CPU per checkpoint) and
this thread does, in order: fdatasync the ledgers, append the index entries
to their files and fsync them and their directory (`write_unsynced`), then
write the checkpoint atomically (the idempotency windows, copied by the loop
as `dedupe.snapshot()`, become the checkpoint's pairs here, and the JSON is
encoded by msgspec, not validated by pydantic: a long C call holds the GIL,
and with it the loop, for its whole length). The loop collects
the outcome on a later turn; on a failure it gives the ledgers and the index
entries back (they are synced again at the next checkpoint) and no
checkpoint names them.

One job at a time, and while one runs the loop changes no index file (no
flush; storage collection waits: `busy`); the loop `commit`s the index
entries when the job's index stage succeeded, else `revert`s them. A crash at any point leaves the
previous checkpoint, whose counts are a prefix of every index file (start-up
cuts files back to it and scans the tail).

Fault injection for tests: `CORRAL_FAULT_CHECKPOINT_KILL_AT=index_synced:N`
SIGKILLs the writer in the N-th checkpoint that synced index files, after
their fsync and before the checkpoint is written."""

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
