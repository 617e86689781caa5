"""The writer process: the only process that appends to the WAL and the ledgers.

Its parts, one job each: transport.py (the sockets), batching.py (batches and
their acks), checkpoints.py, hooks.py (optional parts such as the fleet's
replication); this module recovers the WAL and runs them in one loop.

    python -m actors.writer --state-dir .corral [--segment-bytes N] ...

See docs/wal.md (exit codes: "Exit codes of the writer").
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from types import ModuleType

import structlog
import zmq

from actors.writer import gcpolicy, hooks
from actors.writer.batching import Batcher
from actors.writer.checkpoints import Checkpoints
from actors.writer.dedupe import DEFAULT_WINDOW
from actors.writer.groupcommit import SyncWorker
from actors.writer.ledgers import Ledgers
from actors.writer.recovery import Recovered, recover
from actors.writer.segments import DEFAULT_SEGMENT_BYTES, ActiveSegment
from actors.writer.streamreader import StreamReader
from actors.writer.transport import Transport
from actors.writer.walgc import MARKER_STREAM, Collector, GcOptions
from broker import appendwire, auth, memtrim, protocol, ratelimit, skeleton
from broker import hooks as hook_loader
from broker.control import ControlReporter
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
from broker.statedir import StateDir

EXIT_OK = 0
EXIT_CORRUPT = 65
EXIT_IO = 74
EXIT_LOCKED = 75
EXIT_CONFIG = 78

RECORD_OVERHEAD_BYTES = 4096  # so a page holding one maximal record still fits a frame
# While a batch is being made durable the loop waits for it (not for each
# request) up to this long, then serves the socket anyway (serve()).
IN_FLIGHT_WAIT_MS = 2
# Frames taken in one turn: the durable batch's acks wait for them (they are
# staged first, so that they join the batch submitted at once).
DRAIN_MAX = 256


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
    """The WAL's position (head, index, idempotency windows, ledgers) and the
    loop over the parts that serve, batch and checkpoint it."""

    def __init__(self, state_dir: StateDir, options: WriterOptions) -> None:
        self.state_dir = state_dir
        self.options = options
        self.limits = protocol.Limits(max_frame_bytes=options.max_frame_bytes)
        self.max_record_bytes = options.max_frame_bytes - RECORD_OVERHEAD_BYTES
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")
        self._stopping = False
        self.ledgers = Ledgers(
            {"budget": state_dir.budget_ledger_path, "approvals": state_dir.approvals_ledger_path}
        )
        self.failures_total = 0  # frames whose handling raised
        self._limiter = ratelimit.LogLimiter(self.log.warning)
        self._rate_mark = (time.monotonic(), 0)
        self._rate = 0.0
        # optional parts that see each durable batch before its ack (actors/writer/hooks.py)
        self.hooks: tuple[hooks.WriterHook, ...] = ()
        # the parts: sockets in and out, batches and their acks, checkpoints (recover())
        self.transport = Transport(
            state_dir, curve_on=options.curve, tcp_endpoints=options.tcp_endpoints,
            max_frame_bytes=options.max_frame_bytes, lane_connections=options.lane_connections,
            limits=self.limits, limiter=self._limiter)
        self.batcher = Batcher(self, self.transport, self.max_record_bytes)

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
        self.checkpoints = Checkpoints(
            self, rec.head_seq - rec.scanned_records,
            records=self.options.checkpoint_records,
            interval_s=self.options.checkpoint_interval_s)
        self.log.info(
            "wal_recovered",
            head_seq=self.head,
            scanned_records=rec.scanned_records,
            full_scan=rec.full_scan,
            elapsed_ms=round((time.monotonic() - started) * 1000, 2),
        )
        return rec

    def bind(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Bind the writer's sockets (actors/writer/transport.py)."""
        self.transport.bind(ctx)
        self.endpoint = self.transport.endpoint

    # --- the loop -------------------------------------------------------------
    def request_stop(self) -> None:
        """Return from serve() after the current turn (signal-safe)."""
        self._stopping = True

    def serve(self, reporter: ControlReporter | None) -> None:
        """Receive, frame and acknowledge until SIGTERM. While one batch is being
        made durable by the sync worker, the requests arriving queue on the
        socket; when it is durable they are received and framed, the batch they
        make goes to the disk, then the durable one is acknowledged."""
        transport, batcher = self.transport, self.batcher
        self.worker = SyncWorker(self.segment, self.ledgers, hooks.after_durable(self.hooks))
        batcher.start(self.worker)
        poller = zmq.Poller()
        poller.register(transport.sock, zmq.POLLIN)
        poller.register(self.worker.fileno(), zmq.POLLIN)
        zap = transport.zap
        in_flight_poller = zmq.Poller()
        in_flight_poller.register(self.worker.fileno(), zmq.POLLIN)
        if zap is not None:
            poller.register(zap.socket, zmq.POLLIN)
            in_flight_poller.register(zap.socket, zmq.POLLIN)
        lane = transport.lane
        lane_fd = lane.fileno() if lane is not None else -1
        if lane is not None:
            poller.register(lane_fd, zmq.POLLIN)
        max_batch = self.options.max_batch
        trimmer = memtrim.Trimmer()  # freed memory back to the system after a burst
        if self.hooks:  # the recovered tail through the hooks first (an empty batch)
            batcher.unconfirmed_through = self.head
            batcher.submit()
        try:
            while not self._stopping:
                timeout_ms = 100
                if batcher.inflight is None and batcher.staged.bodies:  # held by the pacer
                    hold = batcher.pacer.hold_s(batcher.staged.waiting(), time.monotonic())
                    timeout_ms = max(1, math.ceil(hold * 1000))
                if batcher.inflight is not None:
                    # the disk is busy: let requests queue meanwhile and take them
                    # all when it is done (one turn per batch, not one per request;
                    # they join the next batch all the same), but wait no longer
                    # than IN_FLIGHT_WAIT_MS (a slow sync, a hook waiting, as the
                    # fleet's for its cluster: reads and pings are answered meanwhile)
                    in_flight_poller.poll(IN_FLIGHT_WAIT_MS)
                    timeout_ms = 0
                events = dict(poller.poll(timeout_ms))
                trimmer.tick(bool(events) or batcher.inflight is not None)
                if zap is not None and zap.socket in events:
                    zap.handle()
                durable = self.worker.fileno() in events
                take = min(max_batch, DRAIN_MAX) if durable else max_batch
                if transport.sock in events:  # first: what waits joins the batch staged now
                    self._process(transport.receive(take))
                    batcher.staged_now()
                if lane_fd in events:
                    self._process(transport.receive_lane(take))
                    batcher.staged_now()
                if durable:
                    batcher.collect(self._stopping)
                self.checkpoints.collect()
                if batcher.inflight is None:  # the files are quiet: checkpoint if due
                    batcher.quiet_then_submit()
                if batcher.storage_full is not None:
                    batcher.probe_storage()
                if reporter is not None:
                    reporter.tick(self.values)
                self._limiter.tick()
                transport.tick(time.monotonic())
            self.log.info("writer_stopping", head_seq=self.head)
            for hook in self.hooks:  # a batch a hook holds fails unacked
                hook.stopping(grace_s=2.0)
            if batcher.inflight is not None:
                batcher.finish(self.worker.collect())
            if batcher.staged.bodies:
                batcher.submit()
                batcher.finish(self.worker.collect())
            self.checkpoints.run()
        finally:
            self.worker.close()

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
                    self.transport.send(parts[0], protocol.error_frame(failure, peeked.msg_id))

    def _handle(self, user: str, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self.transport.refuse(
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
                self.transport.refuse(ident, exc, exc.msg_id, frame)
                return
            if protocol.is_reply(msg):
                self.transport.dropped_total += 1  # an unsolicited reply: never answered
                return
        match msg:
            case appendwire.AppendFrame() | protocol.Append():
                refusal = auth.append_refusal(user, msg.stream, msg.origin, msg.event)
                if refusal is not None:
                    self.transport.refuse(ident, ProtocolError("forbidden", refusal), msg.msg_id)
                    return
                self.batcher.stage(ident, msg)
            case appendwire.AppendManyFrame() | protocol.AppendMany():
                refusal = self._group_refusal(user, msg)
                if refusal is not None:  # one record refused: the whole group is
                    self.transport.refuse(ident, ProtocolError("forbidden", refusal), msg.msg_id)
                    return
                self.batcher.stage_many(ident, msg)
            case protocol.ReadStream():
                self.transport.reply(ident, self.reader.page(msg, self.head))
            case protocol.Ping():
                self.transport.reply(
                    ident, protocol.Pong(msg_id=msg.msg_id, actor="writer", pid=os.getpid())
                )
            case protocol.StatsRequest():
                self.transport.reply(
                    ident,
                    protocol.Stats(msg_id=msg.msg_id, actor="writer", values=self.values()),
                )
            case _:
                self.transport.refuse(
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

    # --- checkpoints and counters --------------------------------------------
    def seal_active(self) -> int | None:
        """Seal the active segment between batches and stage a marker record
        into the next one (walgc.MARKER_STREAM): the sealed segment then no
        longer holds the head and a pass may compact it. The next segment's
        first seq, or None when nothing was sealed or no marker staged."""
        if not self.segment.size:
            return None
        self.segment.seal_requested = True
        if not self.segment.rotate_if_full(self.head + 1):
            return None
        if not self.batcher.stage_own(MARKER_STREAM, "segment_sealed", b"{}"):
            return None  # storage full: no marker to wait for; a later pass compacts it
        return self.segment.first_seq

    def storage_changed(self) -> None:
        """Collection changed the segments: checkpoint twice, so neither the
        checkpoint nor the previous one describes the old files."""
        self.checkpoints.run()
        self.checkpoints.run()

    def statistics(self) -> WriterStatistics:
        now = time.monotonic()
        batcher, transport = self.batcher, self.transport
        mark_t, mark_n = self._rate_mark
        if now - mark_t >= 1.0:
            self._rate = (batcher.appends_total - mark_n) / (now - mark_t)
            self._rate_mark = (now, batcher.appends_total)
        return WriterStatistics(
            head_seq=self.head,
            appends_total=batcher.appends_total,
            duplicates_total=batcher.duplicates_total,
            rejected_total=transport.rejected_total,
            reads_total=self.reader.reads_total,
            batches_total=batcher.batches_total,
            fsyncs_total=batcher.fsyncs_total,
            max_batch=batcher.max_batch_seen,
            appends_per_s=round(self._rate, 1),
            segment_first_seq=self.segment.first_seq,
            segment_bytes=self.segment.size,
            streams=self.index.streams(),
            checkpoint_head_seq=self.checkpoints.head_seq,
            dropped_total=transport.dropped_total,
            failures_total=self.failures_total,
        )

    def values(self) -> dict[str, int | float]:
        full = self.batcher.storage_full
        storage = {"storage_full": int(full is not None),
                   "storage_free_bytes": full.free_bytes if full is not None else -1}
        hooked = {k: v for hook in self.hooks for k, v in hook.values().items()}
        return {**asdict(self.statistics()), **self.batcher.fsync_ms.values(),
                **self.batcher.batch_sizes.values(), **storage, **self.gc.values(), **hooked,
                **self.transport.values()}

    def close(self) -> None:
        self.transport.close()
        self.segment.close()
        self.index.close()
        self.ledgers.close()
        self.reader.close()
        self._lock.release()


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
    skeleton.add_arguments(parser, binds=True, hooks=True)
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
    return skeleton.parse_args(parser, argv, hooks=True)


def _options(args: argparse.Namespace) -> WriterOptions:
    return WriterOptions(
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


# How each failure ends the writer (docs/wal.md, "Exit codes of the writer"):
# the first entry that matches (LockHeldError is a StateDirError, a
# WalCorruptionError a WalError).
EXITS = (
    skeleton.Exit(WalCorruptionError, EXIT_CORRUPT, "wal_corrupt",
                  "{exc}; run `supervisor wal verify` and repair before restarting",
                  lambda exc: {"file": str(exc.path), "offset": exc.offset,
                               "reason": exc.reason}),
    skeleton.Exit(hooks.HaltedError, hooks.EXIT_HALTED, "writer_halted",
                  "{exc}; nothing more is acknowledged here (docs/fleet.md)"),
    skeleton.Exit(DurabilityError, EXIT_IO, "wal_write_failed",
                  "{exc}; nothing of the failed batch was acknowledged"),
    skeleton.Exit((ConfigError, auth.AuthError), EXIT_CONFIG, "writer_config_refused"),
    skeleton.Exit(LockHeldError, EXIT_LOCKED, "writer_lock_held",
                  "{exc}: another writer serves this state directory",
                  lambda exc: {"lock": str(exc.lock_path), "holder_pid": exc.pid}),
    skeleton.Exit(StateDirError, EXIT_CONFIG, "writer_state_dir_unusable"),
    skeleton.Exit(WalError, EXIT_CORRUPT, "wal_unusable"),
    skeleton.Exit(OSError, EXIT_IO, "writer_io_failed", "I/O error: {exc}",
                  lambda _exc: {}, traceback=True),
)


def main(argv: list[str] | None = None) -> int:
    proc = skeleton.Process("writer", EXITS)
    return proc.run(lambda: _run(proc, argv))


def _run(proc: skeleton.Process, argv: list[str] | None) -> int:
    """Recover the WAL, then bind and serve until SIGTERM (the order matters:
    nothing is served before the WAL's head is known)."""
    args, modules = parse_args(argv)
    state_dir = proc.state_dir(args.state_dir)
    log = proc.configure_logging(state_dir, args)
    fd_limit = raise_fd_limit()  # a connection or two an agent (broker/fdlimit.py)
    writer = Writer(state_dir, _options(args))
    writer.hooks = tuple(hook for make in hook_loader.factories(modules, "writer_hook")
                         if (hook := make(args, state_dir)) is not None)
    proc.stop_on_signals(writer.request_stop)
    ctx = proc.context()

    def close_hooks() -> None:
        for hook in writer.hooks:
            hook.close()

    proc.on_close(close_hooks)
    writer.lock()
    writer.recover()
    for hook in writer.hooks:
        hook.start()
    writer.bind(ctx)
    reporter = ControlReporter.from_env(ctx, "writer")
    if reporter is not None:
        proc.on_close(reporter.close)
        reporter.ready()
    log.info("writer_ready", endpoint=writer.endpoint, head_seq=writer.head,
             lane=writer.transport.lane is not None, fd_limit=fd_limit)
    gcpolicy.settle()  # start-up's objects out of every later collection
    writer.serve(reporter)
    writer.close()
    log.info("writer_stopped", head_seq=writer.head)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
