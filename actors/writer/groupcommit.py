"""Group commit: a worker thread writes and fdatasyncs a batch off the loop.

At most one batch is in flight; a batch is acknowledged only once durable.
See docs/wal.md ("Acknowledgement and group commit").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.writer.ledgers import Ledgers
from actors.writer.segments import ActiveSegment
from actors.writer.wal import seal
from broker.errors import DurabilityError

RecordMeta = tuple[str, int, str, str, str | None]  # stream, seq, origin, key, ledger
Ack = tuple[bytes, str, int, bool]  # client identity, msg_id, seq, duplicate
# a multi-record append's: client identity, msg_id, first seq, count, prev_seq, duplicate
ManyAck = tuple[bytes, str, int, int, int | None, bool]


@dataclass
class Batch:
    """Records in seq order and who waits for which seq. Records are staged as
    bodies (`wal.frame_body`) with their CRC so far; `seal()` completes every
    line once the batch is closed and its first and last seq are known."""

    bodies: list[tuple[bytes, int]] = field(default_factory=list)  # body, crc32 of it
    lines: list[bytes] = field(default_factory=list)  # filled by seal()
    meta: list[RecordMeta] = field(default_factory=list)
    keys: dict[tuple[str, str], int] = field(default_factory=dict)
    acks: list[Ack] = field(default_factory=list)
    many_acks: list[ManyAck] = field(default_factory=list)
    # set by the worker once durable
    segment_first_seq: int = 0
    offset: int = -1
    sync_s: float = 0.0  # the fdatasync's duration (metrics: fsync latency histogram)
    first_seq: int = 0  # set by seal()

    def waiting(self) -> int:
        """The appenders waiting on records of this batch (one per append or
        multi-record append, however many records it holds); 0 without a
        record (acks of retries only). What the CommitPacer counts."""
        return len(self.acks) + len(self.many_acks) if self.bodies else 0

    def seal(self, first_seq: int) -> None:
        """Frame every staged body as its final line, naming the batch
        [first_seq, first_seq + n - 1] in each (docs/wal.md, "Start-up": torn writes)."""
        last_seq = first_seq + len(self.bodies) - 1
        self.first_seq = first_seq
        self.lines = [seal(body, crc, first_seq, last_seq) for body, crc in self.bodies]


class SyncWorker:
    """One thread that makes batches durable; wakes the loop through a pipe."""

    def __init__(self, segment: ActiveSegment, ledgers: Ledgers,
                 after_durable: Callable[[int, list[bytes]], None] | None = None) -> None:
        self.segment = segment
        self.ledgers = ledgers
        # the writer's hooks (actors/writer/hooks.py): after the local fdatasync,
        # before the ack; one may block (the fleet's, while its cluster is away),
        # so never in the loop's thread
        self.after_durable = after_durable
        self._wake_r, self._wake_w = os.pipe()
        self._cond = threading.Condition()
        self._todo: Batch | None = None
        self._done: Batch | None = None
        self._error: DurabilityError | None = None
        self._closing = False
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="wal-sync", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when a submitted batch is durable (or failed)."""
        return self._wake_r

    def submit(self, batch: Batch) -> None:
        if self.busy:
            raise RuntimeError("a batch is already in flight")
        self.busy = True
        with self._cond:
            self._todo = batch
            self._cond.notify()

    def run_inline(self, batch: Batch) -> Batch:
        """Make a batch durable in the caller's thread (the worker is idle): a
        lone append does not pay for two thread hand-offs."""
        if self.busy:
            raise RuntimeError("a batch is already in flight")
        self._make_durable(batch)
        return batch

    def collect(self) -> Batch:
        """The durable batch (blocks until it is); raises DurabilityError if
        its write or fdatasync failed: nothing of it may be acknowledged."""
        os.read(self._wake_r, 1)
        self.busy = False
        with self._cond:
            batch, error = self._done, self._error
            self._done = self._error = None
        if error is not None:
            raise error
        assert batch is not None
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._todo is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                batch, self._todo = self._todo, None
            assert batch is not None
            error: DurabilityError | None = None
            try:
                self._make_durable(batch)
            except DurabilityError as exc:
                error = exc
            with self._cond:
                self._done, self._error = batch, error
            os.write(self._wake_w, b"x")

    def _make_durable(self, batch: Batch) -> None:
        batch.segment_first_seq = self.segment.first_seq
        batch.offset = self.segment.write(b"".join(batch.lines))
        started = time.perf_counter()
        self.segment.sync()
        batch.sync_s = time.perf_counter() - started
        for line, meta in zip(batch.lines, batch.meta, strict=True):
            if meta[4] is not None:
                self.ledgers.add(meta[4], line)
        self.ledgers.commit()
        if self.after_durable is not None:
            self.after_durable(batch.first_seq, batch.lines)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)


HOLD_MAX_S = 0.0015  # the longest a staged batch waits for more records (see CommitPacer)


class CommitPacer:
    """When the loop submits a staged batch to an idle worker. Each batch costs
    an fdatasync and a hand-off whatever its size, a few hundred microseconds
    of CPU on this kind of machine (the kernel's journal commit, the thread
    wake-ups), so many appenders on few cores are served with fewer CPU per
    record in fewer, larger batches. It counts the appenders a batch answers
    (`Batch.waiting`), not its records: a batch answering at least half as
    many as the last one goes at once (a lone appender is never held, its
    batches answer one, be it a single append after a multi-record one); a
    smaller one waits until it is that large or until `hold_max_s` after its
    first record was staged, whichever comes first. Pure: the caller gives
    the clock."""

    def __init__(self, hold_max_s: float = HOLD_MAX_S) -> None:
        self.hold_max_s = hold_max_s
        self.last_count = 0
        self.since: float | None = None  # when the staged batch got its first record

    def staged(self, now: float) -> None:
        """Records are staged (the first of the batch sets the clock)."""
        if self.since is None:
            self.since = now

    def submitted(self, count: int) -> None:
        self.last_count = count
        self.since = None

    def hold_s(self, count: int, now: float) -> float:
        """0 to submit a staged batch answering `count` appenders now, else how
        much longer to wait."""
        if count == 0 or 2 * count >= self.last_count:
            return 0.0
        since = now if self.since is None else self.since
        return max(0.0, since + self.hold_max_s - now)
