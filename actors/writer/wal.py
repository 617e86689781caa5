"""The WAL record format and its reader (writer, `wal verify`, tests).

See docs/wal.md ("The record").
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from broker.errors import WalCorruptionError

FORMAT_VERSION = 2  # 2: every record carries "batch":[first,last]
SEGMENT_SUFFIX = ".jsonl"
_CRC_MARK = b',"crc":"'
_SUFFIX_LEN = len(_CRC_MARK) + 8 + 3  # mark, 8 hex digits, '"}\n'
_BATCH_MARK = b',"batch":['
_BATCH_OPEN = len(_BATCH_MARK) - 1
SEAL_MAX_BYTES = len(_BATCH_MARK) + 20 + 1 + 20 + 1 + _SUFFIX_LEN  # what seal() adds at most
_HEADER = re.compile(
    rb'\{"seq":(\d+),"ts":([0-9.]+),"stream":"([^"]*)","event":"([^"]*)",'
    rb'"origin":"([^"]*)","key":"([^"]*)","ledger":(null|"[a-z]+"),"payload":'
)


@dataclass(frozen=True, slots=True)
class WalRecord:
    """One checked record; `line` is the exact bytes on disk, newline included."""

    seq: int
    ts: float
    stream: str
    event: str
    origin: str
    key: str
    ledger: str | None
    line: bytes
    batch_first: int  # first and last seq of the batch the record was written in
    batch_last: int

    def payload_bytes(self) -> bytes:
        """The payload's JSON text, exactly as the client sent it."""
        line = self.line
        m = _HEADER.match(line)
        assert m is not None  # a WalRecord only exists for a matching line
        end = len(line) - _SUFFIX_LEN
        if line[end - 1] == 0x5D:  # "]": ends with its batch (format 2)
            end = line.rfind(_BATCH_MARK, m.end(), end)
        return line[m.end() : end]

    def payload(self) -> object:
        return json.loads(self.payload_bytes())


def frame_body(  # noqa: PLR0917 - the record's fields, in their on-disk order
    seq: int,
    ts: float,
    stream: str,
    event: str,
    origin: str,
    key: str,
    ledger: str | None,
    payload: bytes,
) -> bytes:
    """A record up to and including its payload; `seal()` completes it once
    the batch it belongs to is known. Names must already satisfy the
    protocol's patterns (no quote, no backslash); the payload must have passed
    `payload.check_payload`."""
    ledger_text = "null" if ledger is None else f'"{ledger}"'
    return (
        f'{{"seq":{seq},"ts":{ts:.6f},"stream":"{stream}","event":"{event}",'
        f'"origin":"{origin}","key":"{key}","ledger":{ledger_text},"payload":'
    ).encode() + payload


def seal(body: bytes, body_crc: int, batch_first: int, batch_last: int) -> bytes:
    """The full line (newline included) of a framed body: its batch, then its
    checksum. `body_crc` is `zlib.crc32(body)`, computed while the body was
    staged, so sealing a batch costs only its few added bytes."""
    batch = b'%s%d,%d]' % (_BATCH_MARK, batch_first, batch_last)
    return b'%s%s%s%08x"}\n' % (body, batch, _CRC_MARK, zlib.crc32(batch, body_crc))


def encode_record(  # noqa: PLR0917 - the record's fields, in their on-disk order
    seq: int,
    ts: float,
    stream: str,
    event: str,
    origin: str,
    key: str,
    ledger: str | None,
    payload: bytes,
    batch: tuple[int, int] | None = None,
) -> bytes:
    """Frame a checked payload as one WAL line (newline included); `batch`
    (first, last seq) defaults to a batch of this record alone."""
    body = frame_body(seq, ts, stream, event, origin, key, ledger, payload)
    first, last = batch if batch is not None else (seq, seq)
    return seal(body, zlib.crc32(body), first, last)


def parse_record(line: bytes) -> WalRecord | None:
    """The record in `line`, or None when it is torn, damaged or not a record."""
    if len(line) < _SUFFIX_LEN or not line.endswith(b'"}\n'):
        return None
    cut = len(line) - _SUFFIX_LEN
    if line[cut : cut + len(_CRC_MARK)] != _CRC_MARK:
        return None
    try:
        crc = int(line[cut + len(_CRC_MARK) : cut + len(_CRC_MARK) + 8], 16)
    except ValueError:
        return None
    if zlib.crc32(line[:cut]) != crc:
        return None
    m = _HEADER.match(line)
    if m is None:
        return None
    seq_text, ts, stream, event, origin, key, ledger = m.groups()
    seq = int(seq_text)
    first = last = seq
    if line[cut - 1] == 0x5D:  # "]": the record ends with its batch (format 2)
        bracket = line.rfind(b"[", m.end(), cut)
        comma = line.find(b",", bracket, cut)
        if line[bracket - _BATCH_OPEN : bracket + 1] != _BATCH_MARK or comma < 0:
            return None
        try:
            first, last = int(line[bracket + 1 : comma]), int(line[comma + 1 : cut - 1])
        except ValueError:
            return None
    return WalRecord(
        seq=seq,
        ts=float(ts),
        stream=stream.decode(),
        event=event.decode(),
        origin=origin.decode(),
        key=key.decode(),
        ledger=None if ledger == b"null" else ledger[1:-1].decode(),
        line=line,
        batch_first=first,
        batch_last=last,
    )


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def list_segments(wal_dir: Path) -> list[tuple[int, Path]]:
    """Segments in seq order as (first seq, path); stray files are ignored."""
    found: list[tuple[int, Path]] = []
    if not wal_dir.is_dir():
        return found
    for path in wal_dir.iterdir():
        stem = path.name.removesuffix(SEGMENT_SUFFIX)
        if path.name.endswith(SEGMENT_SUFFIX) and len(stem) == 20 and stem.isdigit():
            found.append((int(stem), path))
    found.sort()
    return found


@dataclass(frozen=True)
class TornTail:
    """An incomplete or damaged final record: safe to cut at `offset`."""

    path: Path
    offset: int
    size: int  # bytes from offset to the end of the file


def iter_segment(path: Path, start_offset: int = 0) -> Iterator[tuple[int, WalRecord | TornTail]]:
    """Yield (offset, record) for each line from `start_offset`; a bad final
    line yields (offset, TornTail). A bad line followed by more data raises
    WalCorruptionError naming the file and byte offset."""
    with open(path, "rb") as f:
        f.seek(start_offset)
        offset = start_offset
        pending_bad: tuple[int, str] | None = None
        while True:
            line = f.readline()
            if not line:
                break
            if pending_bad is not None:
                raise WalCorruptionError(path, pending_bad[0], pending_bad[1])
            record = parse_record(line)
            if record is None:
                reason = (
                    "torn record (no newline)"
                    if not line.endswith(b"\n")
                    else ("checksum or format failure")
                )
                pending_bad = (offset, reason)
            else:
                yield offset, record
            offset += len(line)
        if pending_bad is not None:
            yield pending_bad[0], TornTail(path, pending_bad[0], offset - pending_bad[0])
