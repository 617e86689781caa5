"""Torn writes without a FUSE tool: what a power loss can leave of one
`write()` that had not been fdatasynced. The file is cut into sectors at
fixed file offsets; each sector of the write either reached the disk (its new
bytes) or did not (zeros where the write extended the file). The file's size
may end at the write's end, short of it (after the last sector that reached
the disk), or past it (zeros beyond the data)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

SECTOR = 512


@dataclass(frozen=True)
class Shape:
    present: frozenset[int]  # indexes of the write's sectors that reached the disk
    size: str = "exact"  # "exact", "short" or "past"
    past_bytes: int = 4096


def batch_lines(first_seq: int, count: int, *, stream: str = "agent/a", pad: int = 40,
                ledger_every: int = 0, origin: str = "torn") -> list[bytes]:
    """The lines the writer writes for one batch of `count` appends, built
    here from docs/wal.md ("The record"), not by the writer's own code."""
    last = first_seq + count - 1
    lines = []
    for seq in range(first_seq, last + 1):
        ledger = '"budget"' if ledger_every and seq % ledger_every == 0 else "null"
        payload = '{"pad":"' + "p" * (pad + seq % 7) + '"}'
        body = (
            f'{{"seq":{seq},"ts":1.000000,"stream":"{stream}","event":"turn",'
            f'"origin":"{origin}","key":"t{seq}","ledger":{ledger},"payload":{payload},'
            f'"batch":[{first_seq},{last}]'
        ).encode()
        lines.append(b'%s,"crc":"%08x"}\n' % (body, zlib.crc32(body)))
    return lines


def sectors_of(start: int, length: int) -> list[tuple[int, int]]:
    """The sectors (file offsets, clipped to the write) a write of `length`
    bytes at `start` touches, in order."""
    out = []
    pos = start
    while pos < start + length:
        end = min((pos // SECTOR + 1) * SECTOR, start + length)
        out.append((pos, end))
        pos = end
    return out


def tear(path: Path, data: bytes, shape: Shape) -> None:
    """Append `data` to `path` as a power loss in the middle of its write
    would leave it."""
    start = path.stat().st_size if path.exists() else 0
    pieces = sectors_of(start, len(data))
    out = bytearray()
    last_present = -1
    for i, (a, b) in enumerate(pieces):
        if i in shape.present:
            out += data[a - start : b - start]
            last_present = i
        else:
            out += bytes(b - a)
    if shape.size == "short":
        out = out[: pieces[last_present][1] - start] if last_present >= 0 else bytearray()
    elif shape.size == "past":
        out += bytes(shape.past_bytes)
    with open(path, "ab") as f:
        f.write(bytes(out))
