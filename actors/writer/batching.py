"""The writer's batching and acks (actors/writer/process.py, docs/wal.md):
appends are framed into the staged batch as they arrive (a retried key is
answered with its first seq); a batch goes to the sync worker when the disk
is free (actors/writer/groupcommit.py: one write, one fdatasync, then the
hooks), and its acks go out only once it is durable. A full disk stops
appends until space is back (actors/writer/diskfull.py).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import structlog

from actors.writer import buckets, diskfull
from actors.writer.groupcommit import Batch, CommitPacer, ManyAck, SyncWorker
from actors.writer.payload import check_payload
from actors.writer.wal import SEAL_MAX_BYTES, frame_body, segment_name
from broker import appendwire, protocol
from broker.errors import DurabilityError, ProtocolError

OWN_ORIGIN = "writer"  # the origin of the records the writer stages itself (stage_own)

if TYPE_CHECKING:
    from actors.writer.checkpoints import Checkpoints, WalState
    from actors.writer.hooks import WriterHook
    from actors.writer.streamreader import StreamReader
    from actors.writer.transport import Transport

    class Wal(WalState, Protocol):
        """What batching reads and advances of the writer (process.py)."""

        reader: StreamReader
        checkpoints: Checkpoints
        hooks: tuple[WriterHook, ...]

        def storage_changed(self) -> None: ...

        def seal_active(self) -> int | None: ...


class Batcher:
    """The staged batch, the batch in flight, and their acks."""

    def __init__(self, w: Wal, transport: Transport, max_record_bytes: int) -> None:
        self.w = w
        self.transport = transport
        self.max_record_bytes = max_record_bytes
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")
        self.inflight: Batch | None = None
        self.staged = Batch()
        self.pacer = CommitPacer()  # larger batches under many appenders (groupcommit.py)
        self.storage_full: diskfull.StorageFull | None = None
        self.unconfirmed_through = 0  # recovered records the hooks have not seen yet
        self._stream_last: dict[str, int] = {}  # newest seq of each stream, staged included
        # counters
        self.appends_total = self.duplicates_total = 0
        self.batches_total = self.fsyncs_total = self.max_batch_seen = 0
        self.fsync_ms, self.batch_sizes = buckets.fsync_ms(), buckets.batch_records()

    def start(self, worker: SyncWorker) -> None:
        self.worker = worker

    def staged_now(self) -> None:
        """Frames were just handled: the pacer notes a staged batch."""
        if self.staged.bodies:
            self.pacer.staged(time.monotonic())

    def stage(self, ident: bytes, msg: protocol.Append | appendwire.AppendFrame) -> None:
        """Frame one append into the staged batch (or answer a retried key)."""
        key = (msg.origin, msg.key)
        seq = self.w.dedupe.lookup(msg.origin, msg.key)
        if seq is not None and seq <= self.unconfirmed_through:  # once the hooks saw it
            self.duplicates_total += 1
            self.staged.acks.append((ident, msg.msg_id, seq, True))
            return
        if seq is not None:  # durable already: answer at once
            self.duplicates_total += 1
            self.transport.send_acks([(ident, msg.msg_id, seq, True)])
            return
        inflight = self.inflight
        for batch in (inflight, self.staged):
            if batch is not None and (seq := batch.keys.get(key)) is not None:
                self.duplicates_total += 1
                batch.acks.append((ident, msg.msg_id, seq, True))  # answered with that batch
                return
        if self.storage_full is not None:  # stopped: no new work until space is back
            self._refuse_full(ident, msg.msg_id)
            return
        try:
            check_payload(msg.payload)
        except ProtocolError as exc:
            self.transport.refuse(ident, exc, msg.msg_id)
            return
        in_flight = len(inflight.bodies) if inflight is not None else 0
        seq = self.w.head + in_flight + len(self.staged.bodies) + 1
        body = frame_body(
            seq, time.time(), msg.stream, msg.event, msg.origin, msg.key, msg.ledger, msg.payload
        )
        if len(body) + SEAL_MAX_BYTES > self.max_record_bytes:
            self.transport.refuse(
                ident,
                ProtocolError(
                    "invalid_payload",
                    f"record of {len(body) + SEAL_MAX_BYTES} bytes > {self.max_record_bytes}",
                ),
                msg.msg_id,
            )
            return
        staged = self.staged
        staged.bodies.append((body, zlib.crc32(body)))
        staged.meta.append((msg.stream, seq, msg.origin, msg.key, msg.ledger))
        staged.keys[key] = seq
        staged.acks.append((ident, msg.msg_id, seq, False))
        self._stream_last[msg.stream] = seq

    def stage_own(self, stream: str, event: str, payload: bytes) -> bool:
        """Frame a record of the writer's own (no appender waits on it) into
        the staged batch; False when storage is full (nothing staged)."""
        if self.storage_full is not None:
            return False
        in_flight = len(self.inflight.bodies) if self.inflight is not None else 0
        seq = self.w.head + in_flight + len(self.staged.bodies) + 1
        key = f"{event}-{time.time_ns()}"
        body = frame_body(seq, time.time(), stream, event, OWN_ORIGIN, key, None, payload)
        self.staged.bodies.append((body, zlib.crc32(body)))
        self.staged.meta.append((stream, seq, OWN_ORIGIN, key, None))
        self.staged.keys[(OWN_ORIGIN, key)] = seq
        self._stream_last[stream] = seq
        return True

    def _stream_prev(self, stream: str) -> int:
        """The seq of the stream's newest record, staged ones included (0: none)."""
        last = self._stream_last.get(stream)
        if last is None:
            last = self._stream_last[stream] = self.w.index.last_seq(stream)
        return last

    def stage_many(self, ident: bytes,
                    msg: protocol.AppendMany | appendwire.AppendManyFrame) -> None:
        """Frame a multi-record append as consecutive records of the staged
        batch, all of them or none; a retry whose keys were all written is
        answered with the first seq (with its batch, if that is not durable yet)."""
        if self.storage_full is not None:  # stopped: no new work until space is back
            self._refuse_full(ident, msg.msg_id)
            return
        origin = msg.origin
        items: Sequence[protocol.AppendItem | appendwire.AppendItemFrame] = msg.records
        keys = [item.key for item in items]
        if len(set(keys)) != len(keys):
            self.transport.refuse(
                ident, ProtocolError("invalid_message", "append_many: keys repeat"), msg.msg_id)
            return
        known: list[int | None] = []
        holder: Batch | None = None  # the pending batch that holds an earlier copy
        for key in keys:
            seq = self.w.dedupe.lookup(origin, key)
            if seq is None:
                for batch in (self.inflight, self.staged):
                    if batch is not None and (seq := batch.keys.get((origin, key))) is not None:
                        holder = batch
                        break
            known.append(seq)
        if any(seq is not None for seq in known):
            first = known[0]
            if first is None or known != list(range(first, first + len(known))):
                self.transport.refuse(ident, ProtocolError(
                    "invalid_message", "append_many: its keys are partly written already"),
                    msg.msg_id)
                return
            self.duplicates_total += len(keys)
            ack: ManyAck = (ident, msg.msg_id, first, len(keys), None, True)
            if holder is None and first > self.unconfirmed_through:
                self.transport.send_many_acks([ack])
            else:  # a recovered group is answered once the hooks saw it too
                (holder or self.staged).many_acks.append(ack)
            return
        try:
            for item in items:
                check_payload(item.payload)
        except ProtocolError as exc:
            self.transport.refuse(ident, exc, msg.msg_id)
            return
        inflight = self.inflight
        in_flight = len(inflight.bodies) if inflight is not None else 0
        first = self.w.head + in_flight + len(self.staged.bodies) + 1
        count = len(items)
        ts = time.time()
        bodies = []
        for i, item in enumerate(items):
            body = frame_body(first + i, ts, msg.stream, item.event, origin, item.key,
                              item.ledger, item.payload)
            if len(body) + SEAL_MAX_BYTES > self.max_record_bytes:
                self.transport.refuse(ident, ProtocolError(
                    "invalid_payload",
                    f"record of {len(body) + SEAL_MAX_BYTES} bytes > {self.max_record_bytes}"),
                    msg.msg_id)
                return
            bodies.append(body)
        # one batch holds the whole group (one write, one fdatasync, one "batch"
        # span in every record): start-up keeps a batch whole or cuts it whole
        prev = self._stream_prev(msg.stream)
        staged = self.staged
        for i, (item, body) in enumerate(zip(items, bodies, strict=True)):
            staged.bodies.append((body, zlib.crc32(body)))
            staged.meta.append((msg.stream, first + i, origin, item.key, item.ledger))
            staged.keys[(origin, item.key)] = first + i
        self._stream_last[msg.stream] = first + count - 1
        staged.many_acks.append((ident, msg.msg_id, first, count, prev, False))

    def quiet_then_submit(self, inline_ok: bool = True) -> None:
        """The worker is idle (no batch in flight): storage collection and the
        checkpoint if due, then the staged batch to the disk."""
        if not self.w.checkpoints.busy:  # collection changes index files
            self.w.gc.tick(self.w)
        self.w.checkpoints.maybe()
        staged = self.staged
        if staged.bodies or staged.acks or staged.many_acks:
            if self.pacer.hold_s(staged.waiting(), time.monotonic()) > 0:
                return  # a few more records first (CommitPacer); the loop comes back
            self.submit(inline_ok)

    def submit(self, inline_ok: bool = True) -> None:
        batch, self.staged = self.staged, Batch()
        self.pacer.submitted(batch.waiting())
        batch.seal(self.w.head + 1)  # the worker is idle: head is the last durable seq
        if inline_ok and batch.waiting() == 1 and not self.w.hooks:
            # one appender waits (a lone append, or one agent's multi-record
            # group): sync here, no hand-off to wait for; nobody else's request
            # is being framed meanwhile (with hooks the worker thread runs
            # them, so it goes through the worker)
            try:
                durable = self.worker.run_inline(batch)
            except DurabilityError as exc:
                self._durability_failed(batch, exc)
                return
            # acknowledged before its bookkeeping: the appender's next request
            # overlaps it, and no request is read before finish has run
            self.acknowledge(durable)
            self.finish(durable, acknowledge=False)
            return
        self.inflight = batch
        self.worker.submit(batch)

    def collect(self, stopping: bool) -> None:
        """The batch in flight is durable: finish it, and put the batch staged
        meanwhile on the disk before its acks go out (pipelined: the next
        fdatasync runs while this batch is acknowledged)."""
        batch = self.inflight
        try:
            done = self.worker.collect()
            # a rotation due: acks, then the rotation, as a lone batch (the worker idle)
            rotating = self.w.segment.rotation_due()
            self.finish(done, acknowledge=rotating)
        except DurabilityError as exc:
            assert batch is not None
            self._durability_failed(batch, exc)
            return
        if rotating:
            return
        if not stopping:
            self.w.checkpoints.collect()
            self.quiet_then_submit(inline_ok=False)
        self.acknowledge(done)

    def _durability_failed(self, batch: Batch, exc: DurabilityError) -> None:
        """A batch's write or fdatasync failed: nothing of it is acknowledged.
        A full or failing disk stops appends until space is back
        (actors/writer/diskfull.py); any other failure exits 74."""
        self.inflight = None
        code = diskfull.space_errno(exc)
        if code is None:
            raise exc
        offset = batch.offset if batch.offset >= 0 else self.w.segment.size
        diskfull.rollback(self.w.segment, offset, self.w.ledgers, self.w.head)
        self.storage_full = diskfull.stopped(exc, self.w.segment.path, code)
        self.log.error("storage_full", file=self.storage_full.path, error=self.storage_full.error,
                       free_bytes=self.storage_full.free_bytes, head_seq=self.w.head)
        staged, self.staged = self.staged, Batch()
        for ident, msg_id, *_ in [*batch.acks, *staged.acks]:
            self._refuse_full(ident, msg_id)
        for ident, msg_id, *_ in [*batch.many_acks, *staged.many_acks]:
            self._refuse_full(ident, msg_id)

    def _refuse_full(self, ident: bytes, msg_id: str) -> None:
        full = self.storage_full
        assert full is not None
        self.transport.rejected_total += 1
        detail = f"no space for the WAL at {full.path} ({full.free_bytes} bytes free); retry later"
        self.transport.send(
            ident, protocol.error_frame(ProtocolError("storage_full", detail), msg_id))

    def probe_storage(self) -> None:
        full = self.storage_full
        assert full is not None
        now = time.monotonic()
        if now - full.probed_at < diskfull.PROBE_INTERVAL_S:
            return
        full.probed_at, full.probes = now, full.probes + 1
        full.free_bytes = diskfull.free_bytes(self.w.state_dir.wal_dir)
        if diskfull.probe(self.w.state_dir.wal_dir):
            self.log.info("storage_recovered", file=full.path, free_bytes=full.free_bytes,
                          stopped_s=round(time.time() - full.since, 3), head_seq=self.w.head)
            self.storage_full = None

    def finish(self, batch: Batch, acknowledge: bool = True) -> None:
        """The batch is durable: index it, remember its keys, acknowledge it
        (unless not `acknowledge`: the caller does, with `acknowledge`, once
        it has put the next batch on the disk), rotate the segment if full."""
        self.inflight = None
        self.unconfirmed_through = 0  # the hooks saw everything up to this batch
        self.fsyncs_total += 1
        first, offset = batch.segment_first_seq, batch.offset
        for line, (stream, seq, origin, key, ledger) in zip(batch.lines, batch.meta, strict=True):
            self.w.index.add(stream, seq, first, offset, len(line))
            self.w.dedupe.remember(origin, key, seq)
            if ledger is not None:
                self.w.ledger_last_seq[ledger] = seq
            self.w.last_record_offset = offset
            offset += len(line)
        count = len(batch.lines)
        self.w.head += count
        self.w.head_segment = first
        self.w.head_end_offset = offset
        self.appends_total += count
        self.batches_total += 1
        self.max_batch_seen = max(self.max_batch_seen, count)
        self.fsync_ms.observe(batch.sync_s * 1000)
        self.batch_sizes.observe(count)
        if acknowledge:
            self.acknowledge(batch)
        if self.w.segment.rotate_if_full(self.w.head + 1):
            self.log.info("wal_segment_rotated", segment=segment_name(self.w.segment.first_seq))

    def acknowledge(self, batch: Batch) -> None:
        """Send a durable batch's acks (only ever called with a batch whose
        fdatasync returned: `finish`'s)."""
        self.transport.send_acks(batch.acks)
        self.transport.send_many_acks(batch.many_acks)
