"""The writer process: the only process that appends to the WAL and the
ledgers. One ROUTER socket (`run/writer.sock`) and the local lane
(`run/writer.lane`, actors/writer/lane.py: the same frames as Unix socket
packets) take appends straight from clients (no broker hop); every append
waiting when a batch begins shares that batch's fdatasync (group commit), and
is acknowledged only after it.

    python -m actors.writer --state-dir .corral [--segment-bytes N] ...

Exit codes: 0 clean stop; 65 WAL corruption before the tail (file and offset
logged: an operator must act); 74 a write or fdatasync failed (nothing of the
batch was acknowledged; restart re-scans); 75 another writer holds the lock;
77 a hook halted it (actors/writer/hooks.py: the fleet fenced this host); 78 the
state directory or options are unusable.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import signal
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from types import FrameType, ModuleType

import structlog
import zmq

from actors.writer import buckets, diskfull, gcpolicy, hooks
from actors.writer.checkpointsync import CheckpointThread, Job, Outcome
from actors.writer.dedupe import DEFAULT_WINDOW
from actors.writer.groupcommit import Ack, Batch, CommitPacer, ManyAck, SyncWorker
from actors.writer.lane import LaneServer, lane_path
from actors.writer.ledgers import Ledgers
from actors.writer.payload import check_payload
from actors.writer.recovery import Recovered, recover
from actors.writer.segments import DEFAULT_SEGMENT_BYTES, ActiveSegment
from actors.writer.streamindex import IndexWriteError
from actors.writer.streamreader import StreamReader
from actors.writer.wal import SEAL_MAX_BYTES, frame_body, segment_name
from actors.writer.walgc import Collector, GcOptions
from broker import appendwire, auth, curve, logconfig, memtrim, protocol, ratelimit
from broker import hooks as hook_loader
from broker.control import ControlReporter
from broker.curve import check_endpoints
from broker.durable import write_atomic
from broker.errors import (
    ConfigError,
    DurabilityError,
    LockHeldError,
    ProtocolError,
    StateDirError,
    WalCorruptionError,
    WalError,
)
from broker.fdlimit import raise_fd_limit
from broker.pidlock import PidLock
from broker.statedir import StateDir, bind_umask

EXIT_OK = 0
EXIT_CORRUPT = 65
EXIT_IO = 74
EXIT_LOCKED = 75
EXIT_CONFIG = 78

RECORD_OVERHEAD_BYTES = 4096  # so a page holding one maximal record still fits a frame
# Replies queued for one client that does not read them; more are dropped
# (counted in dropped_total, logged at a bounded rate). A client with a few
# requests in flight never comes near it.
SNDHWM = 32
# While a batch is being made durable the loop waits for it (not for each
# request) up to this long, then serves the socket anyway (serve()).
IN_FLIGHT_WAIT_MS = 2
# Frames taken in one turn: the durable batch's acks wait for them (they are
# staged first, so that they join the batch submitted at once).
DRAIN_MAX = 256
# pyzmq's flags and options as plain ints: an enum `|` per ack cost a Python call
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
RCVHWM = 1000  # requests queued from one client before ZeroMQ stops reading it


@dataclass(frozen=True)
class WriterOptions:
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    checkpoint_records: int = 20_000
    checkpoint_interval_s: float = 2.0
    dedupe_window: int = DEFAULT_WINDOW
    max_batch: int = 4096
    max_frame_bytes: int = protocol.DEFAULT_LIMITS.max_frame_bytes
    curve: bool = False  # CURVE on every connection (required for tcp://)
    # the local lane's cap (None: from the fd limit; 0: no lane)
    lane_connections: int | None = None
    tcp_endpoints: tuple[str, ...] = ()
    # WAL retention and compaction (actors/writer/walgc.py)
    gc: GcOptions = field(default_factory=GcOptions)


@dataclass(frozen=True)
class WriterStatistics:
    head_seq: int
    appends_total: int
    duplicates_total: int
    rejected_total: int
    reads_total: int
    batches_total: int
    fsyncs_total: int
    max_batch: int
    appends_per_s: float
    segment_first_seq: int
    segment_bytes: int
    streams: int
    checkpoint_head_seq: int
    dropped_total: int  # replies not delivered (client gone or not reading), replies not answered
    failures_total: int  # frames whose handling raised (answered with internal_error)


class Writer:
    def __init__(self, state_dir: StateDir, options: WriterOptions) -> None:
        self.state_dir = state_dir
        self.options = options
        self.limits = protocol.Limits(max_frame_bytes=options.max_frame_bytes)
        self.max_record_bytes = options.max_frame_bytes - RECORD_OVERHEAD_BYTES
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")
        self._stopping = False
        self.storage_full: diskfull.StorageFull | None = None
        self._zap: auth.ZapHandler | None = None
        self.lane: LaneServer | None = None
        self.ledgers = Ledgers(
            {"budget": state_dir.budget_ledger_path, "approvals": state_dir.approvals_ledger_path}
        )
        # counters
        self.appends_total = self.duplicates_total = self.rejected_total = 0
        self.batches_total = self.fsyncs_total = self.max_batch_seen = 0
        self.fsync_ms, self.batch_sizes = buckets.fsync_ms(), buckets.batch_records()
        self.dropped_total = self.failures_total = 0
        self._limiter = ratelimit.LogLimiter(self.log.warning)
        self._rate_mark = (time.monotonic(), 0)
        self._rate = 0.0
        # optional parts that see each durable batch before its ack (actors/writer/hooks.py)
        self.hooks: tuple[hooks.WriterHook, ...] = ()
        self.unconfirmed_through = 0  # recovered records the hooks have not seen yet

    # --- start-up -------------------------------------------------------------
    def lock(self) -> None:
        """Hold run/writer.lock for the process lifetime (one writer per WAL)."""
        self._lock = PidLock(self.state_dir.run_dir / "writer.lock")
        self._lock.acquire()

    def recover(self) -> Recovered:
        started = time.monotonic()
        rec = recover(self.state_dir, self.options.dedupe_window, self.ledgers)
        self.head = rec.head_seq
        self.dedupe = rec.dedupe
        self.index = rec.index
        self.reader = StreamReader(self.state_dir.wal_dir, self.index)
        self.reader.floor_seq = rec.floor_seq
        self.gc = Collector(self.state_dir, self.options.gc)
        self.head_segment = rec.head_segment_first_seq
        self.head_end_offset = rec.head_end_offset
        self.last_record_offset = rec.last_record_offset
        self.ledger_last_seq = dict(rec.ledger_last_seq)
        self._derived_failing: tuple[object, ...] | None = None
        self._stream_last: dict[str, int] = {}  # newest seq of each stream, staged included
        self.segment = ActiveSegment(
            self.state_dir.wal_dir, rec.segment_first_seq, self.options.segment_bytes
        )
        if rec.repaired is not None:
            self.log.warning(
                "wal_tail_repaired",
                file=str(rec.repaired.path),
                offset=rec.repaired.offset,
                bad_offset=rec.repaired.bad_offset,
                cut_bytes=rec.repaired.size,
                first_seq_cut=rec.repaired.first_seq,
                reason=rec.repaired.reason,
            )
        for repair in rec.ledger_repairs:
            self.log.warning(
                "ledger_repaired",
                ledger=repair.ledger,
                file=str(repair.path),
                offset=repair.offset,
                cut_bytes=repair.size,
                reason=repair.reason,
            )
        if rec.index_problem:
            self.log.error("stream_index_unusable", reason=rec.index_problem)
        if rec.full_scan:
            self.log.info("checkpoint_not_used", reason=rec.checkpoint_note)
        elif rec.checkpoint_note:
            self.log.warning("checkpoint_fell_back", reason=rec.checkpoint_note)
        for ledger, count in rec.ledger_appends.items():
            if count:
                self.log.warning("ledger_completed_from_wal", ledger=ledger, records=count)
        for ledger, count in rec.ledger_dropped.items():
            self.log.error("ledger_cut_to_wal", ledger=ledger, records=count, head_seq=rec.head_seq)
        # The scanned tail is checkpointed at the first loop turn, after the
        # writer answers: start-up does not wait for it. Never checkpointed: the
        # interval has passed, however recently the machine booted (0.0 would
        # not do: monotonic time counts from the boot, so with a machine up for
        # less than the interval the first checkpoint waited for it).
        self._checkpoint_head = rec.head_seq - rec.scanned_records
        self._checkpoint_at = -math.inf
        self.checkpointer = CheckpointThread(self.ledgers)  # syncs and writes it off the loop
        self.log.info(
            "wal_recovered",
            head_seq=self.head,
            scanned_records=rec.scanned_records,
            full_scan=rec.full_scan,
            elapsed_ms=round((time.monotonic() - started) * 1000, 2),
        )
        return rec

    def bind(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Bind run/writer.sock (and any tcp:// endpoints, CURVE only); the
        endpoints actually bound are written to run/writer.endpoints."""
        check_endpoints(self.options.tcp_endpoints, self.options.curve)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # The transport drops peers sending over twice the limit; frames between
        # the limit and that get a typed frame_too_large reply from decode().
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.options.max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises: dropped, counted
        # every connection authenticates (broker/auth.py): PLAIN, or CURVE with --curve
        keyring = auth.ensure_keys(self.state_dir)
        if self.options.curve:
            server = curve.load_server(curve.keys_dir(self.state_dir.root))
            self._zap = auth.ZapHandler(ctx, keyring, server.authorized_dir)
            curve.apply_server(self.sock, server)
        else:
            self._zap = auth.ZapHandler(ctx, keyring)
            auth.apply_server(self.sock)
        endpoint = self.state_dir.endpoint("writer")
        old = bind_umask()
        try:
            path = endpoint.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)  # a stale socket file of a dead writer; we hold the lock
            if not self.options.curve and self.options.lane_connections != 0:
                self._bind_lane(keyring)  # (with CURVE every local client uses keys too)
            self.sock.bind(endpoint)
            bound = [endpoint]
            for extra in self.options.tcp_endpoints:
                self.sock.bind(extra)
                bound.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        finally:
            os.umask(old)
        self.endpoint = endpoint
        write_atomic(
            self.state_dir.run_dir / "writer.endpoints", ("\n".join(bound) + "\n").encode()
        )

    def _bind_lane(self, keyring: auth.Keyring) -> None:
        """The local lane beside the ROUTER; without it (a path too long for
        a Unix socket, say) clients use the ROUTER alone."""
        path = lane_path(self.state_dir.run_dir)
        try:
            cap = self.options.lane_connections or lane_capacity()
            self.lane = LaneServer(path, keyring, max_connections=cap)
        except OSError as exc:
            self.log.warning("lane_unavailable", path=str(path), error=str(exc))

    # --- the loop -------------------------------------------------------------
    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def serve(self, reporter: ControlReporter | None) -> None:
        """Receive, frame and acknowledge until SIGTERM. While one batch is being
        made durable by the sync worker, the requests arriving queue on the
        socket; when it is durable they are received and framed, the batch they
        make goes to the disk, then the durable one is acknowledged."""
        self.worker = SyncWorker(self.segment, self.ledgers, hooks.after_durable(self.hooks))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.worker.fileno(), zmq.POLLIN)
        zap = self._zap
        in_flight_poller = zmq.Poller()
        in_flight_poller.register(self.worker.fileno(), zmq.POLLIN)
        if zap is not None:
            poller.register(zap.socket, zmq.POLLIN)
            in_flight_poller.register(zap.socket, zmq.POLLIN)
        lane = self.lane
        lane_fd = lane.fileno() if lane is not None else -1
        if lane is not None:
            poller.register(lane_fd, zmq.POLLIN)
        max_batch = self.options.max_batch
        self.inflight: Batch | None = None
        self.staged = Batch()
        self.pacer = CommitPacer()  # larger batches under many appenders (groupcommit.py)
        trimmer = memtrim.Trimmer()  # freed memory back to the system after a burst
        if self.hooks:  # the recovered tail through the hooks first (an empty batch)
            self.unconfirmed_through = self.head
            self._submit()
        try:
            while not self._stopping:
                timeout_ms = 100
                if self.inflight is None and self.staged.bodies:  # held by the pacer
                    hold = self.pacer.hold_s(self.staged.waiting(), time.monotonic())
                    timeout_ms = max(1, math.ceil(hold * 1000))
                if self.inflight is not None:
                    # the disk is busy: let requests queue meanwhile and take them
                    # all when it is done (one turn per batch, not one per request;
                    # they join the next batch all the same), but wait no longer
                    # than IN_FLIGHT_WAIT_MS (a slow sync, a hook waiting, as the
                    # fleet's for its cluster: reads and pings are answered meanwhile)
                    in_flight_poller.poll(IN_FLIGHT_WAIT_MS)
                    timeout_ms = 0
                events = dict(poller.poll(timeout_ms))
                trimmer.tick(bool(events) or self.inflight is not None)
                if zap is not None and zap.socket in events:
                    zap.handle()
                durable = self.worker.fileno() in events
                if self.sock in events:  # first: what waits joins the batch staged now
                    self._drain(min(max_batch, DRAIN_MAX) if durable else max_batch)
                if lane_fd in events:
                    assert lane is not None
                    self._drain_lane(lane, min(max_batch, DRAIN_MAX) if durable else max_batch)
                if durable:
                    self._collect()
                self._collect_checkpoint()
                if self.inflight is None:  # the files are quiet: checkpoint if due
                    self._quiet_then_submit()
                if self.storage_full is not None:
                    self._probe_storage()
                if reporter is not None:
                    reporter.tick(self.values)
                self._limiter.tick()
                if lane is not None:
                    lane.tick(time.monotonic())
            self.log.info("writer_stopping", head_seq=self.head)
            for hook in self.hooks:  # a batch a hook holds fails unacked
                hook.stopping(grace_s=2.0)
            if self.inflight is not None:
                self._finish(self.worker.collect())
            if self.staged.bodies:
                self._submit()
                self._finish(self.worker.collect())
            self._checkpoint()
        finally:
            self.worker.close()

    def _drain(self, max_batch: int) -> None:
        """Receive and handle what waits on the socket (up to `max_batch` frames)."""
        sock = self.sock
        frames: list[tuple[str, list[bytes]]] = []
        while len(frames) < max_batch:
            try:  # the first frame carries the sender's authenticated name
                head = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            parts = [head.bytes]
            frame = head
            while frame.more:  # the frame says it (getsockopt built an enum per call)
                frame = sock.recv(copy=False)
                parts.append(frame.bytes)
            frames.append((auth.user_of(head), parts))
            if len(frames) == 1 and not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                break  # a lone request: asked, not found by a zmq.Again (an exception
                # built per turn, with its message, cost more than the rest of a turn);
                # past the first, the turn ends on one zmq.Again instead of asking
                # after every frame (2 us each: pyzmq makes an enum per getsockopt)
        self._process(frames)
        if self.staged.bodies:
            self.pacer.staged(time.monotonic())

    def _drain_lane(self, lane: LaneServer, max_batch: int) -> None:
        """`_drain` for the lane's ready connections."""
        got = lane.receive(max_batch)
        for ident, exc in got.refusals:
            self._refuse(ident, exc, None)
        if got.frames:
            self._process(got.frames)
        if self.staged.bodies:
            self.pacer.staged(time.monotonic())

    def _process(self, frames: list[tuple[str, list[bytes]]]) -> None:
        for user, parts in frames:
            try:
                self._handle(user, parts)
            except (DurabilityError, WalError):
                raise  # the files failed: exit and let recovery run (docs/wal.md)
            except Exception as exc:  # the last line of defence: log, go on
                self.failures_total += 1
                if self._limiter.allow():
                    self.log.exception("frame_handling_failed", failures_total=self.failures_total)
                peeked = protocol.peek(parts[-1], self.limits)
                if len(parts) == 2 and not peeked.is_reply:
                    failure = ProtocolError("internal_error", f"failed: {type(exc).__name__}")
                    self._send(parts[0], protocol.error_frame(failure, peeked.msg_id))

    def _handle(self, user: str, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self._refuse(
                parts[0],
                ProtocolError("malformed_frame", f"{len(parts) - 1} frames, expected 1"),
                None,
                parts[-1],
            )
            return
        ident, frame = parts
        # the append kinds in one typed C decode; anything else (or anything it
        # cannot vouch for) through protocol.decode (broker/appendwire.py)
        msg: protocol.Message | appendwire.AppendFrame | appendwire.AppendManyFrame | None
        msg = appendwire.decode_request(frame, self.limits)
        if msg is None:
            try:
                msg = protocol.decode(frame, self.limits)
            except ProtocolError as exc:
                self._refuse(ident, exc, exc.msg_id, frame)
                return
            if protocol.is_reply(msg):
                self.dropped_total += 1  # an unsolicited reply or error: never answered
                return
        match msg:
            case appendwire.AppendFrame() | protocol.Append():
                refusal = auth.append_refusal(user, msg.stream, msg.origin, msg.event)
                if refusal is not None:
                    self._refuse(ident, ProtocolError("forbidden", refusal), msg.msg_id)
                    return
                self._stage(ident, msg)
            case appendwire.AppendManyFrame() | protocol.AppendMany():
                refusal = self._group_refusal(user, msg)
                if refusal is not None:  # one record refused: the whole group is
                    self._refuse(ident, ProtocolError("forbidden", refusal), msg.msg_id)
                    return
                self._stage_many(ident, msg)
            case protocol.ReadStream():
                self._reply(ident, self.reader.page(msg, self.head))
            case protocol.Ping():
                self._reply(
                    ident, protocol.Pong(msg_id=msg.msg_id, actor="writer", pid=os.getpid())
                )
            case protocol.StatsRequest():
                self._reply(
                    ident,
                    protocol.Stats(msg_id=msg.msg_id, actor="writer", values=self.values()),
                )
            case _:
                self._refuse(
                    ident,
                    ProtocolError(
                        "unexpected_message", f"the writer does not serve {msg.kind}"
                    ),
                    getattr(msg, "msg_id", None),
                )

    @staticmethod
    def _group_refusal(user: str,
                       msg: protocol.AppendMany | appendwire.AppendManyFrame) -> str | None:
        """auth.append_refusal for every record of a group: the first refusal."""
        for item in msg.records:
            refusal = auth.append_refusal(user, msg.stream, msg.origin, item.event)
            if refusal is not None:
                return refusal
        return None

    def _stage(self, ident: bytes, msg: protocol.Append | appendwire.AppendFrame) -> None:
        """Frame one append into the staged batch (or answer a retried key)."""
        key = (msg.origin, msg.key)
        seq = self.dedupe.lookup(msg.origin, msg.key)
        if seq is not None and seq <= self.unconfirmed_through:  # once the hooks saw it
            self.duplicates_total += 1
            self.staged.acks.append((ident, msg.msg_id, seq, True))
            return
        if seq is not None:  # durable already: answer at once
            self.duplicates_total += 1
            self._send_acks([(ident, msg.msg_id, seq, True)])
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
            self._refuse(ident, exc, msg.msg_id)
            return
        in_flight = len(inflight.bodies) if inflight is not None else 0
        seq = self.head + in_flight + len(self.staged.bodies) + 1
        body = frame_body(
            seq, time.time(), msg.stream, msg.event, msg.origin, msg.key, msg.ledger, msg.payload
        )
        if len(body) + SEAL_MAX_BYTES > self.max_record_bytes:
            self._refuse(
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

    def _stream_prev(self, stream: str) -> int:
        """The seq of the stream's newest record, staged ones included (0: none)."""
        last = self._stream_last.get(stream)
        if last is None:
            last = self._stream_last[stream] = self.index.last_seq(stream)
        return last

    def _stage_many(self, ident: bytes,
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
            self._refuse(ident, ProtocolError("invalid_message", "append_many: keys repeat"),
                         msg.msg_id)
            return
        known: list[int | None] = []
        holder: Batch | None = None  # the pending batch that holds an earlier copy
        for key in keys:
            seq = self.dedupe.lookup(origin, key)
            if seq is None:
                for batch in (self.inflight, self.staged):
                    if batch is not None and (seq := batch.keys.get((origin, key))) is not None:
                        holder = batch
                        break
            known.append(seq)
        if any(seq is not None for seq in known):
            first = known[0]
            if first is None or known != list(range(first, first + len(known))):
                self._refuse(ident, ProtocolError(
                    "invalid_message", "append_many: its keys are partly written already"),
                    msg.msg_id)
                return
            self.duplicates_total += len(keys)
            ack: ManyAck = (ident, msg.msg_id, first, len(keys), None, True)
            if holder is None and first > self.unconfirmed_through:
                self._send_many_acks([ack])
            else:  # a recovered group is answered once the hooks saw it too
                (holder or self.staged).many_acks.append(ack)
            return
        try:
            for item in items:
                check_payload(item.payload)
        except ProtocolError as exc:
            self._refuse(ident, exc, msg.msg_id)
            return
        inflight = self.inflight
        in_flight = len(inflight.bodies) if inflight is not None else 0
        first = self.head + in_flight + len(self.staged.bodies) + 1
        count = len(items)
        ts = time.time()
        bodies = []
        for i, item in enumerate(items):
            body = frame_body(first + i, ts, msg.stream, item.event, origin, item.key,
                              item.ledger, item.payload)
            if len(body) + SEAL_MAX_BYTES > self.max_record_bytes:
                self._refuse(ident, ProtocolError(
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

    def _quiet_then_submit(self, inline_ok: bool = True) -> None:
        """The worker is idle (no batch in flight): storage collection and the
        checkpoint if due, then the staged batch to the disk."""
        if not self.checkpointer.busy:  # collection changes index files
            self.gc.tick(self)
        self._maybe_checkpoint()
        staged = self.staged
        if staged.bodies or staged.acks or staged.many_acks:
            if self.pacer.hold_s(staged.waiting(), time.monotonic()) > 0:
                return  # a few more records first (CommitPacer); the loop comes back
            self._submit(inline_ok)

    def _submit(self, inline_ok: bool = True) -> None:
        batch, self.staged = self.staged, Batch()
        self.pacer.submitted(batch.waiting())
        batch.seal(self.head + 1)  # the worker is idle: head is the last durable seq
        if inline_ok and batch.waiting() == 1 and not self.hooks:
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
            # overlaps it, and no request is read before _finish has run
            self._acknowledge(durable)
            self._finish(durable, acknowledge=False)
            return
        self.inflight = batch
        self.worker.submit(batch)

    def _collect(self) -> None:
        """The batch in flight is durable: finish it, and put the batch staged
        meanwhile on the disk before its acks go out (pipelined: the next
        fdatasync runs while this batch is acknowledged)."""
        batch = self.inflight
        try:
            done = self.worker.collect()
            # a rotation due: acks, then the rotation, as a lone batch (the worker idle)
            rotating = self.segment.rotation_due()
            self._finish(done, acknowledge=rotating)
        except DurabilityError as exc:
            assert batch is not None
            self._durability_failed(batch, exc)
            return
        if rotating:
            return
        if not self._stopping:
            self._collect_checkpoint()
            self._quiet_then_submit(inline_ok=False)
        self._acknowledge(done)

    def _durability_failed(self, batch: Batch, exc: DurabilityError) -> None:
        """A batch's write or fdatasync failed: nothing of it is acknowledged.
        A full or failing disk stops appends until space is back
        (actors/writer/diskfull.py); any other failure exits 74."""
        self.inflight = None
        code = diskfull.space_errno(exc)
        if code is None:
            raise exc
        offset = batch.offset if batch.offset >= 0 else self.segment.size
        diskfull.rollback(self.segment, offset, self.ledgers, self.head)
        self.storage_full = diskfull.stopped(exc, self.segment.path, code)
        self.log.error("storage_full", file=self.storage_full.path, error=self.storage_full.error,
                       free_bytes=self.storage_full.free_bytes, head_seq=self.head)
        staged, self.staged = self.staged, Batch()
        for ident, msg_id, *_ in [*batch.acks, *staged.acks]:
            self._refuse_full(ident, msg_id)
        for ident, msg_id, *_ in [*batch.many_acks, *staged.many_acks]:
            self._refuse_full(ident, msg_id)

    def _refuse_full(self, ident: bytes, msg_id: str) -> None:
        full = self.storage_full
        assert full is not None
        self.rejected_total += 1
        detail = f"no space for the WAL at {full.path} ({full.free_bytes} bytes free); retry later"
        self._send(ident, protocol.error_frame(ProtocolError("storage_full", detail), msg_id))

    def _probe_storage(self) -> None:
        full = self.storage_full
        assert full is not None
        now = time.monotonic()
        if now - full.probed_at < diskfull.PROBE_INTERVAL_S:
            return
        full.probed_at, full.probes = now, full.probes + 1
        full.free_bytes = diskfull.free_bytes(self.state_dir.wal_dir)
        if diskfull.probe(self.state_dir.wal_dir):
            self.log.info("storage_recovered", file=full.path, free_bytes=full.free_bytes,
                          stopped_s=round(time.time() - full.since, 3), head_seq=self.head)
            self.storage_full = None

    def _finish(self, batch: Batch, acknowledge: bool = True) -> None:
        """The batch is durable: index it, remember its keys, acknowledge it
        (unless not `acknowledge`: the caller does, with `_acknowledge`, once
        it has put the next batch on the disk), rotate the segment if full."""
        self.inflight = None
        self.unconfirmed_through = 0  # the hooks saw everything up to this batch
        self.fsyncs_total += 1
        first, offset = batch.segment_first_seq, batch.offset
        for line, (stream, seq, origin, key, ledger) in zip(batch.lines, batch.meta, strict=True):
            self.index.add(stream, seq, first, offset, len(line))
            self.dedupe.remember(origin, key, seq)
            if ledger is not None:
                self.ledger_last_seq[ledger] = seq
            self.last_record_offset = offset
            offset += len(line)
        count = len(batch.lines)
        self.head += count
        self.head_segment = first
        self.head_end_offset = offset
        self.appends_total += count
        self.batches_total += 1
        self.max_batch_seen = max(self.max_batch_seen, count)
        self.fsync_ms.observe(batch.sync_s * 1000)
        self.batch_sizes.observe(count)
        if acknowledge:
            self._acknowledge(batch)
        if self.segment.rotate_if_full(self.head + 1):
            self.log.info("wal_segment_rotated", segment=segment_name(self.segment.first_seq))

    def _acknowledge(self, batch: Batch) -> None:
        """Send a durable batch's acks (only ever called with a batch whose
        fdatasync returned: `_finish`'s)."""
        self._send_acks(batch.acks)
        self._send_many_acks(batch.many_acks)

    def _send_acks(self, acks: list[Ack]) -> None:
        # values are ours and known valid: encoded in C without a model, and sent
        # as two frames (what send_multipart does, without its per-part checks);
        # ROUTER_MANDATORY refuses at the first frame, so nothing half-sent stays.
        # A lane connection's ack is one packet, sent by the lane's acker.
        if not acks:
            return
        send = self.sock.send
        more = _NOBLOCK_SNDMORE
        encode = appendwire.encode_append_ok
        lane = self.lane
        on_lane: list[tuple[bytes, bytes]] = []
        for ident, msg_id, seq, duplicate in acks:
            frame = encode(msg_id, seq, duplicate)
            if lane is not None and lane.owns(ident):
                on_lane.append((ident, frame))
                continue
            try:
                send(ident, more)
                send(frame, _NOBLOCK)
            except zmq.ZMQError as exc:
                self._dropped(ident, _reason(exc), exc.errno)
        if on_lane:
            assert lane is not None
            lane.send_acks(on_lane)

    def _send_many_acks(self, acks: list[ManyAck]) -> None:
        if not acks:
            return
        send = self.sock.send
        more = _NOBLOCK_SNDMORE
        encode = appendwire.encode_append_many_ok
        lane = self.lane
        on_lane: list[tuple[bytes, bytes]] = []
        for ident, msg_id, first, count, prev, duplicate in acks:
            frame = encode(msg_id, first, count, prev, duplicate)
            if lane is not None and lane.owns(ident):
                on_lane.append((ident, frame))
                continue
            try:
                send(ident, more)
                send(frame, _NOBLOCK)
            except zmq.ZMQError as exc:
                self._dropped(ident, _reason(exc), exc.errno)
        if on_lane:
            assert lane is not None
            lane.send_acks(on_lane)

    # --- replies --------------------------------------------------------------
    def _reply(
        self,
        ident: bytes,
        message: protocol.Records | protocol.Error | protocol.Pong | protocol.Stats,
    ) -> None:
        self._send(ident, protocol.encode(message))

    def _refuse(
        self, ident: bytes, exc: ProtocolError, msg_id: str | None, frame: bytes | None = None
    ) -> None:
        """Answer a refused frame with an `error`, unless the frame is itself a
        reply (an error is never answered with an error)."""
        self.rejected_total += 1
        peeked = protocol.peek(frame, self.limits) if frame is not None else None
        if msg_id is None and peeked is not None:
            msg_id = peeked.msg_id
        if self._limiter.allow():
            self.log.warning(
                "frame_rejected", code=exc.code, detail=exc.detail[:200], msg_id=msg_id
            )
        if peeked is not None and peeked.is_reply:
            self.dropped_total += 1
            return
        self._send(ident, protocol.error_frame(exc, msg_id))

    def _send(self, ident: bytes, frame: bytes) -> None:
        if self.lane is not None:
            sent = self.lane.send(ident, frame)
            if sent == "too_large":  # a reply (a page of records) no packet holds
                sent = self.lane.send(ident, protocol.error_frame(ProtocolError(
                    protocol.ErrorCode.FRAME_TOO_LARGE,
                    "the reply is larger than a lane packet: ask on the ROUTER"),
                    protocol.peek(frame, self.limits).msg_id))
            if sent is not None:
                if sent != "sent":
                    self._dropped(ident, sent)
                return
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._dropped(ident, _reason(exc), exc.errno)

    def _dropped(self, ident: bytes, reason: str, errno: int | None = None) -> None:
        """A reply could not be queued: the client is gone (EHOSTUNREACH, a
        closed lane connection) or does not read (EAGAIN: SNDHWM replies wait
        already; a lane socket's buffer is full). It is dropped; the client's
        retry (same msg_id, same key) gets it again."""
        self.dropped_total += 1
        if self._limiter.allow():
            self.log.warning(
                "reply_dropped",
                peer=ident[:64].hex(),
                errno=errno,
                reason=reason,
                dropped_total=self.dropped_total,
            )

    # --- checkpoints and counters --------------------------------------------
    def _maybe_checkpoint(self) -> None:
        behind = self.head - self._checkpoint_head
        if behind >= self.options.checkpoint_records or (
            behind and time.monotonic() - self._checkpoint_at >= self.options.checkpoint_interval_s
        ):
            self._checkpoint(wait=False)

    def _checkpoint(self, wait: bool = True) -> None:
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
        if self.checkpointer.busy:
            if not wait:
                return
            self._checkpoint_done(self.checkpointer.wait())
        self._checkpoint_at = time.monotonic()
        ledgers = self.ledgers.take_unsynced()
        failures, unsynced = self.index.take_pending()  # written in the thread
        if failures:  # the entries stay in memory
            self.index.revert(unsynced)
            self.ledgers.restore_unsynced(ledgers)
            failed = failures[0]
            self._derived_failed("stream_index_write", str(failed.path), failed.error,
                                 streams=len(failures))
            return
        self.checkpointer.start(Job(
            ledgers, unsynced, self.state_dir.stream_index_dir, self.state_dir.checkpoint_path,
                dict(
                    head_seq=self.head,
                    segment_first_seq=self.head_segment if self.head else self.segment.first_seq,
                    offset=self.head_end_offset,
                    last_record_offset=self.last_record_offset if self.head else -1,
                    dedupe=self.dedupe.snapshot(),
                    index_counts=self.index.counts_with(unsynced),
                    ledger_sizes=self.ledgers.sizes(),
                    ledger_last_seq=dict(self.ledger_last_seq),  # the loop goes on changing it
                    storage_epoch=self.gc.epoch,
                )))
        if wait:
            self._checkpoint_done(self.checkpointer.wait())

    def _collect_checkpoint(self) -> None:
        outcome = self.checkpointer.poll()
        if outcome is not None:
            self._checkpoint_done(outcome)

    def _checkpoint_done(self, outcome: Outcome | None) -> None:
        """A checkpoint job ended: note it, or give back what it could not sync."""
        if outcome is None:
            return
        job, exc = outcome.job, outcome.error
        if exc is None or outcome.stage == "checkpoint_write":  # the index entries are durable
            self.index.commit(job.index)
        if exc is None:
            if self._derived_failing is not None:
                self.log.info(f"{self._derived_failing[0]}_recovered")
                self._derived_failing = None
            self._checkpoint_head = job.head_seq
            return
        if outcome.stage != "checkpoint_write":  # the index entries were not made durable
            self.index.revert(job.index)
        if outcome.stage == "ledger_sync":
            self.ledgers.restore_unsynced(job.ledgers)
            if not isinstance(exc, DurabilityError) or diskfull.space_errno(exc) is None:
                raise exc
            self._derived_failed("ledger_sync", str(exc), str(exc.__cause__))
        elif outcome.stage == "stream_index_write" and isinstance(exc, IndexWriteError):
            failed = exc.failures[0]  # named as when the loop wrote them (one log line)
            self._derived_failed("stream_index_write", str(failed.path), failed.error,
                                 streams=len(exc.failures))
        elif outcome.stage == "stream_index_write":
            self._derived_failed("stream_index_write", str(job.index_dir), str(exc),
                                 streams=len(job.index.written))
        elif isinstance(exc, OSError):
            self._derived_failed("checkpoint_write", str(job.path), str(exc))
        else:
            raise exc

    def storage_changed(self) -> None:
        """Collection changed the segments: checkpoint twice, so neither the
        checkpoint nor the previous one describes the old files."""
        self._checkpoint()
        self._checkpoint()

    def _derived_failed(self, what: str, file: str, error: str, **extra: int) -> None:
        """Log a derived file's failure once (again only when it changes)."""
        key = (what, file, *extra.values())
        if self._derived_failing != key:
            self._derived_failing = key
            self.log.error(f"{what}_failed", file=file, error=error, checkpoint_skipped=True,
                           **extra)

    def statistics(self) -> WriterStatistics:
        now = time.monotonic()
        mark_t, mark_n = self._rate_mark
        if now - mark_t >= 1.0:
            self._rate = (self.appends_total - mark_n) / (now - mark_t)
            self._rate_mark = (now, self.appends_total)
        return WriterStatistics(
            head_seq=self.head,
            appends_total=self.appends_total,
            duplicates_total=self.duplicates_total,
            rejected_total=self.rejected_total,
            reads_total=self.reader.reads_total,
            batches_total=self.batches_total,
            fsyncs_total=self.fsyncs_total,
            max_batch=self.max_batch_seen,
            appends_per_s=round(self._rate, 1),
            segment_first_seq=self.segment.first_seq,
            segment_bytes=self.segment.size,
            streams=self.index.streams(),
            checkpoint_head_seq=self._checkpoint_head,
            dropped_total=self.dropped_total,
            failures_total=self.failures_total,
        )

    def values(self) -> dict[str, int | float]:
        full = self.storage_full
        storage = {"storage_full": int(full is not None),
                   "storage_free_bytes": full.free_bytes if full is not None else -1}
        hooked = {k: v for hook in self.hooks for k, v in hook.values().items()}
        lane = self.lane.values() if self.lane is not None else {}
        return {**asdict(self.statistics()), **self.fsync_ms.values(),
                **self.batch_sizes.values(), **storage, **self.gc.values(), **hooked, **lane}

    def close(self) -> None:
        if self._zap is not None:
            self._zap.close()
        if self.lane is not None:
            self.lane.close()
        self.segment.close()
        self.index.close()
        self.ledgers.close()
        self.reader.close()
        self._lock.release()


def _reason(exc: zmq.ZMQError) -> str:
    return "not_reading" if exc.errno == zmq.EAGAIN else "gone"


def lane_capacity() -> int:
    """How many lane connections the writer holds: half its fd limit (the rest
    for segments, ZeroMQ's sockets and the ROUTER's peers), at most 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 2))


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a count (0 or more)")
    return value


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[ModuleType]]:
    """The options, and the `--hook` modules (imported: they add their own)."""
    parser = argparse.ArgumentParser(
        prog="python -m actors.writer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = WriterOptions()
    parser.add_argument("--state-dir", default=None, help="state directory (default ./.corral)")
    parser.add_argument("--segment-bytes", type=int, default=d.segment_bytes)
    parser.add_argument("--checkpoint-records", type=int, default=d.checkpoint_records)
    parser.add_argument("--checkpoint-interval-s", type=float, default=d.checkpoint_interval_s)
    parser.add_argument("--dedupe-window", type=int, default=d.dedupe_window)
    parser.add_argument("--max-batch", type=int, default=d.max_batch)
    parser.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes)
    parser.add_argument("--lane-connections", type=_count, default=None, metavar="N",
                        help="connections the local lane (run/writer.lane) holds; 0: no lane "
                             "(default: half the fd limit, at most 4096)")
    g = d.gc
    parser.add_argument("--gc-interval-s", type=float, default=g.interval_s)
    parser.add_argument("--gc-max-wal-bytes", type=int, default=g.max_wal_bytes)
    parser.add_argument("--gc-keep-records", type=int, default=g.keep_records)
    parser.add_argument("--gc-archive", action="store_true", help="archive truncated segments")
    parser.add_argument("--gc-disposable", action="append", default=[], metavar="PATTERN",
                        help="streams (fnmatch) that need nothing below the rewind horizon")
    curve.add_arguments(parser)
    logconfig.add_arguments(parser)
    hook_loader.add_argument(parser)
    modules = hook_loader.load(argv, parser)
    return parser.parse_args(argv), modules


def main(argv: list[str] | None = None) -> int:
    try:
        args, modules = parse_args(argv)
    except ConfigError as exc:
        print(f"writer: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        state_dir = StateDir.at(args.state_dir).ensure()
    except StateDirError as exc:
        print(f"writer: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    log = logconfig.configure(
        "writer",
        state_dir.log_path("writer"),
        level=args.log_level,
        max_bytes=args.log_max_bytes,
        backups=args.log_backups,
    )
    options = WriterOptions(
        segment_bytes=args.segment_bytes,
        checkpoint_records=args.checkpoint_records,
        checkpoint_interval_s=args.checkpoint_interval_s,
        dedupe_window=args.dedupe_window,
        max_batch=args.max_batch,
        max_frame_bytes=args.max_frame_bytes,
        lane_connections=args.lane_connections,
        curve=args.curve,
        tcp_endpoints=tuple(args.tcp),
        gc=GcOptions(
            interval_s=args.gc_interval_s,
            max_wal_bytes=args.gc_max_wal_bytes,
            keep_records=args.gc_keep_records,
            archive=args.gc_archive,
            disposable=tuple(args.gc_disposable),
        ),
    )
    fd_limit = raise_fd_limit()  # a connection or two an agent (broker/fdlimit.py)
    writer = Writer(state_dir, options)
    try:
        writer.hooks = tuple(hook for make in hook_loader.factories(modules, "writer_hook")
                             if (hook := make(args, state_dir)) is not None)
    except ConfigError as exc:
        print(f"writer: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    signal.signal(signal.SIGTERM, writer.request_stop)
    signal.signal(signal.SIGINT, writer.request_stop)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    reporter = None
    try:
        writer.lock()
        writer.recover()
        for hook in writer.hooks:
            hook.start()
        writer.bind(ctx)
        reporter = ControlReporter.from_env(ctx, "writer")
        if reporter is not None:
            reporter.ready()
        log.info("writer_ready", endpoint=writer.endpoint, head_seq=writer.head,
                 lane=writer.lane is not None, fd_limit=fd_limit)
        gcpolicy.settle()  # start-up's objects out of every later collection
        writer.serve(reporter)
    except WalCorruptionError as exc:
        log.error("wal_corrupt", file=str(exc.path), offset=exc.offset, reason=exc.reason)
        print(
            f"writer: {exc}; run `supervisor wal verify` and repair before restarting",
            file=sys.stderr,
        )
        return EXIT_CORRUPT
    except hooks.HaltedError as exc:
        log.error("writer_halted", error=str(exc))
        print(f"writer: {exc}; nothing more is acknowledged here (docs/fleet.md)",
              file=sys.stderr)
        return hooks.EXIT_HALTED
    except DurabilityError as exc:
        log.error("wal_write_failed", error=str(exc))
        print(f"writer: {exc}; nothing of the failed batch was acknowledged", file=sys.stderr)
        return EXIT_IO
    except (ConfigError, auth.AuthError) as exc:
        log.error("writer_config_refused", error=str(exc))
        print(f"writer: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except LockHeldError as exc:
        log.error("writer_lock_held", lock=str(exc.lock_path), holder_pid=exc.pid)
        print(f"writer: {exc}: another writer serves this state directory", file=sys.stderr)
        return EXIT_LOCKED
    except StateDirError as exc:
        log.error("writer_state_dir_unusable", error=str(exc))
        print(f"writer: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except WalError as exc:
        log.error("wal_unusable", error=str(exc))
        print(f"writer: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except OSError as exc:
        log.exception("writer_io_failed")
        print(f"writer: I/O error: {exc}", file=sys.stderr)
        return EXIT_IO
    else:
        writer.close()
        log.info("writer_stopped", head_seq=writer.head)
        return EXIT_OK
    finally:
        for hook in writer.hooks:
            hook.close()
        if reporter is not None:
            reporter.close()
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
