"""Torn writes without a FUSE tool: what a power loss can leave of one
`write()` that had not been fdatasynced. The file is cut into sectors at
fixed file offsets; each sector of the write either reached the disk (its new
bytes) or did not (zeros where the write extended the file). The file's size
may end at the write's end, short of it (after the last sector that reached
the disk), or past it (zeros beyond the data)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.writer.wal import encode_record

SECTOR = 512


@dataclass(frozen=True)
class Shape:
    present: frozenset[int]  # indexes of the write's sectors that reached the disk
    size: str = "exact"  # "exact", "short" or "past"
    past_bytes: int = 4096


def batch_lines(first_seq: int, count: int, *, stream: str = "agent/a", pad: int = 40,
                ledger_every: int = 0, origin: str = "torn") -> list[bytes]:
    """The lines the writer would write for one batch of `count` appends."""
    last = first_seq + count - 1
    return [
        encode_record(
            seq, 1.0, stream, "turn", origin, f"t{seq}",
            "budget" if ledger_every and seq % ledger_every == 0 else None,
            b'{"pad":"' + b"p" * (pad + seq % 7) + b'"}',
            batch=(first_seq, last),
        )
        for seq in range(first_seq, last + 1)
    ]


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
