"""The writer's checkpoints (actors/writer/process.py, docs/wal.md): when one
is due, the loop takes a snapshot of the writer's state (the idempotency
windows copied, the stream index entries taken from memory, the ledgers'
unsynced lines) and the checkpoint thread (actors/writer/checkpointsync.py)
makes the ledgers durable, writes the index files and replaces the
checkpoint. The index and the checkpoint are derived files: a failure is
logged once and the writer serves on; a restart rebuilds what is missing.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from actors.writer import diskfull
from actors.writer.checkpointsync import CheckpointThread, Job, Outcome
from actors.writer.streamindex import IndexWriteError
from broker.errors import DurabilityError

if TYPE_CHECKING:
    from actors.writer.dedupe import DedupeWindows
    from actors.writer.ledgers import Ledgers
    from actors.writer.segments import ActiveSegment
    from actors.writer.streamindex import StreamIndex
    from actors.writer.walgc import Collector
    from broker.statedir import StateDir


class WalState(Protocol):
    """What a checkpoint names of the writer (actors/writer/process.py)."""

    state_dir: StateDir
    head: int
    head_segment: int
    head_end_offset: int
    last_record_offset: int
    segment: ActiveSegment
    dedupe: DedupeWindows
    index: StreamIndex
    ledgers: Ledgers
    ledger_last_seq: dict[str, int]
    gc: Collector


class Checkpoints:
    """The writer's checkpointing: when, what, and what failed."""

    def __init__(self, w: WalState, head_seq: int, *, records: int, interval_s: float) -> None:
        self.w = w
        self.records = records
        self.interval_s = interval_s
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")
        # The scanned tail is checkpointed at the first loop turn, after the
        # writer answers: start-up does not wait for it. Never checkpointed: the
        # interval has passed, however recently the machine booted (0.0 would
        # not do: monotonic time counts from the boot, so with a machine up for
        # less than the interval the first checkpoint waited for it).
        self.head_seq = head_seq  # the head the newest checkpoint names
        self._at = -math.inf
        self.thread = CheckpointThread(w.ledgers)  # syncs and writes it off the loop
        self._derived_failing: tuple[object, ...] | None = None

    @property
    def busy(self) -> bool:
        return self.thread.busy

    def maybe(self) -> None:
        """Checkpoint when enough records or enough time went by."""
        behind = self.w.head - self.head_seq
        if behind >= self.records or (behind and time.monotonic() - self._at >= self.interval_s):
            self.run(wait=False)

    def run(self, wait: bool = True) -> None:
        """Make the ledgers durable, flush the stream index, then replace the
        checkpoint. The index and the checkpoint are derived files: when either
        cannot be written the writer logs it once and serves on; no checkpoint
        names index entries that are not on disk, so a restart rebuilds what is
        missing from the WAL (docs/wal.md). The ledgers are fdatasynced here, not
        per batch: the checkpoint names their sizes as durable. The loop only
        takes the snapshot (the idempotency windows copied, the index entries
        taken from memory); the index writes, the syncs and the checkpoint's
        encoding and write run in the checkpoint thread (actors/writer/
        checkpointsync.py), collected on a later turn unless `wait`."""
        if self.thread.busy:
            if not wait:
                return
            self._done(self.thread.wait())
        self._at = time.monotonic()
        ledgers = self.w.ledgers.take_unsynced()
        failures, unsynced = self.w.index.take_pending()  # written in the thread
        if failures:  # the entries stay in memory
            self.w.index.revert(unsynced)
            self.w.ledgers.restore_unsynced(ledgers)
            failed = failures[0]
            self.derived_failed("stream_index_write", str(failed.path), failed.error,
                                streams=len(failures))
            return
        w = self.w
        self.thread.start(Job(
            ledgers, unsynced, w.state_dir.stream_index_dir, w.state_dir.checkpoint_path,
            dict(
                head_seq=w.head,
                segment_first_seq=w.head_segment if w.head else w.segment.first_seq,
                offset=w.head_end_offset,
                last_record_offset=w.last_record_offset if w.head else -1,
                dedupe=w.dedupe.snapshot(),
                index_counts=w.index.counts_with(unsynced),
                ledger_sizes=w.ledgers.sizes(),
                ledger_last_seq=dict(w.ledger_last_seq),  # the loop goes on changing it
                storage_epoch=w.gc.epoch,
            )))
        if wait:
            self._done(self.thread.wait())

    def collect(self) -> None:
        """Note a job the thread finished since the last turn."""
        outcome = self.thread.poll()
        if outcome is not None:
            self._done(outcome)

    def _done(self, outcome: Outcome | None) -> None:
        """A checkpoint job ended: note it, or give back what it could not sync."""
        if outcome is None:
            return
        job, exc = outcome.job, outcome.error
        if exc is None or outcome.stage == "checkpoint_write":  # the index entries are durable
            self.w.index.commit(job.index)
        if exc is None:
            if self._derived_failing is not None:
                self.log.info(f"{self._derived_failing[0]}_recovered")
                self._derived_failing = None
            self.head_seq = job.head_seq
            return
        if outcome.stage != "checkpoint_write":  # the index entries were not made durable
            self.w.index.revert(job.index)
        if outcome.stage == "ledger_sync":
            self.w.ledgers.restore_unsynced(job.ledgers)
            if not isinstance(exc, DurabilityError) or diskfull.space_errno(exc) is None:
                raise exc
            self.derived_failed("ledger_sync", str(exc), str(exc.__cause__))
        elif outcome.stage == "stream_index_write" and isinstance(exc, IndexWriteError):
            failed = exc.failures[0]  # named as when the loop wrote them (one log line)
            self.derived_failed("stream_index_write", str(failed.path), failed.error,
                                streams=len(exc.failures))
        elif outcome.stage == "stream_index_write":
            self.derived_failed("stream_index_write", str(job.index_dir), str(exc),
                                streams=len(job.index.written))
        elif isinstance(exc, OSError):
            self.derived_failed("checkpoint_write", str(job.path), str(exc))
        else:
            raise exc

    def derived_failed(self, what: str, file: str, error: str, **extra: int) -> None:
        """Log a derived file's failure once (again only when it changes)."""
        key = (what, file, *extra.values())
        if self._derived_failing != key:
            self._derived_failing = key
            self.log.error(f"{what}_failed", file=file, error=error, checkpoint_skipped=True,
                           **extra)
