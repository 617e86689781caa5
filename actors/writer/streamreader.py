"""Serving `read_stream`: one stream's records from a seq, in bounded pages.

See docs/wal.md ("The stream index").
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path

import structlog

from actors.writer.streamindex import StreamIndex
from actors.writer.wal import parse_record, segment_name
from broker import protocol

MAX_OPEN_SEGMENTS = 16
HOLD_S = 30.0  # a reader that paged part of a stream holds the rest this long


class StreamReader:
    def __init__(self, wal_dir: Path, index: StreamIndex) -> None:
        self.wal_dir = wal_dir
        self.index = index
        self.reads_total = 0
        self.floor_seq = 1  # retention truncated every seq below (docs/storage.md)
        self.held: dict[str, tuple[int, float]] = {}  # stream -> (next seq, monotonic time)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")

    def page(self, msg: protocol.ReadStream, head_seq: int) -> protocol.Records | protocol.Error:
        """The page answering `msg` (only records the index holds: durable ones)."""
        self.reads_total += 1
        try:
            return self._page(msg, head_seq)
        except OSError as exc:  # an index file or segment that cannot be read
            self._log.error("wal_read_failed", stream=msg.stream, error=str(exc))
            return protocol.Error(
                msg_id=msg.msg_id,
                code=protocol.ErrorCode.INTERNAL_ERROR,
                detail=f"cannot read stream {msg.stream}: {exc}"[:2000],
            )

    def _page(self, msg: protocol.ReadStream, head_seq: int) -> protocol.Records | protocol.Error:
        from_seq = max(msg.from_seq, self.floor_seq)  # below the floor: truncated
        entries = self.index.lookup(msg.stream, from_seq, msg.max_records + 1)
        records: list[bytes] = []
        total = 0
        next_seq = from_seq
        for seq, segment, offset, length in entries[: msg.max_records]:
            if records and total + length > msg.max_bytes:
                break
            line = os.pread(self._segment_fd(segment), length, offset)
            record = parse_record(line)
            if record is None or record.seq != seq:
                self._log.error("wal_read_failed", segment=segment, offset=offset, seq=seq)
                return protocol.Error(
                    msg_id=msg.msg_id,
                    code=protocol.ErrorCode.INTERNAL_ERROR,
                    detail=f"record seq {seq} at {segment_name(segment)}:{offset} failed its check",
                )
            records.append(line[:-1])
            total += length
            next_seq = seq + 1
        more = len(records) < len(entries)
        if more:  # the reader comes back for the rest: retention keeps it
            self.held[msg.stream] = (next_seq, time.monotonic())
        else:
            self.held.pop(msg.stream, None)
        return protocol.Records(
            msg_id=msg.msg_id,
            stream=msg.stream,
            records=records,
            next_seq=next_seq,
            more=more,
            head_seq=head_seq,
        )

    def _segment_fd(self, first_seq: int) -> int:
        fd = self._fds.get(first_seq)
        if fd is None:
            if len(self._fds) >= MAX_OPEN_SEGMENTS:
                os.close(self._fds.popitem(last=False)[1])
            fd = os.open(self.wal_dir / segment_name(first_seq), os.O_RDONLY)
            self._fds[first_seq] = fd
        return fd

    def read_line(self, segment: int, offset: int, length: int) -> bytes:
        """The bytes of one indexed record (storage collection reads procs'
        facts through this: actors/writer/procsfloor.py)."""
        return os.pread(self._segment_fd(segment), length, offset)

    def held_floor(self) -> int | None:
        """The lowest seq a reader paging a stream still needs (None: none)."""
        now = time.monotonic()
        for stream, (_, at) in list(self.held.items()):
            if now - at > HOLD_S:
                del self.held[stream]
        return min((seq for seq, _ in self.held.values()), default=None)

    def forget(self, first_seq: int) -> None:
        """Close a segment's descriptor (it was replaced or removed)."""
        fd = self._fds.pop(first_seq, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
