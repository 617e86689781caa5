"""Packs crossing hosts for remote subagents: chunks, and the files at each end.

See docs/fleet.md ("Subagents on another host").
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from actors.changesets import confined
from actors.changesets.snapshot import write_all
from actors.subagents import remotepack
from broker import protocol
from broker.errors import ChangeSetRefusedError

TASK_MAX = 64 * 1024  # the task file's text in an offer
TRANSFER_TTL_S = 120.0  # a pack whose chunks stop coming is dropped after this
MAX_TRANSFERS = 16  # packs being received at once (the oldest is dropped)


def chunks(blob: bytes) -> list[protocol.SubagentChunk]:
    digest = remotepack.sha256(blob)
    size = protocol.CHUNK_BYTES
    total = max(1, -(-len(blob) // size))
    return [protocol.SubagentChunk(pack_sha256=digest, pack_bytes=len(blob), index=i,
                                   total=total, data=blob[i * size:(i + 1) * size])
            for i in range(total)]


@dataclass
class _Transfer:
    total: int
    size: int
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)


class Transfers:
    """Packs being received, chunk by chunk, per (sending host, digest);
    bounded in count, in bytes and in time."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._open: dict[tuple[str, str], _Transfer] = {}

    def add(self, host: str, chunk: protocol.SubagentChunk) -> str | None:
        """None, or why the chunk is refused."""
        now = time.monotonic()
        for key in [k for k, t in self._open.items() if now - t.started > TRANSFER_TTL_S]:
            del self._open[key]
        size = protocol.CHUNK_BYTES
        total = max(1, -(-chunk.pack_bytes // size))
        if chunk.pack_bytes > self.max_bytes:
            return f"pack of {chunk.pack_bytes} bytes over the bound {self.max_bytes}"
        expected = min(size, chunk.pack_bytes - chunk.index * size)
        if chunk.total != total or chunk.index >= total or len(chunk.data) != max(0, expected):
            return "chunk does not fit its pack (index, total or size)"
        key = (host, chunk.pack_sha256)
        transfer = self._open.get(key)
        if transfer is None:
            # at most MAX_TRANSFERS packs and twice the bound in bytes: the oldest go
            while self._open and (len(self._open) >= MAX_TRANSFERS or chunk.pack_bytes + sum(
                    t.size for t in self._open.values()) > 2 * self.max_bytes):
                del self._open[next(iter(self._open))]
            transfer = self._open[key] = _Transfer(total, chunk.pack_bytes, now)
        elif transfer.size != chunk.pack_bytes:
            return "chunk does not fit its pack (size)"
        transfer.parts[chunk.index] = chunk.data
        return None

    def take(self, host: str, digest: str) -> bytes | None:
        """The whole pack once every chunk came (removed), else None."""
        transfer = self._open.get((host, digest))
        if transfer is None or len(transfer.parts) != transfer.total:
            return None
        del self._open[(host, digest)]
        return b"".join(transfer.parts[i] for i in range(transfer.total))


def read_task(path: Path) -> bytes:
    """The task file's text for the offer: a regular file (no link, FIFO or
    device: the path is the model's) of at most TASK_MAX bytes."""
    try:
        fd = os.open(path, confined.FILE_FLAGS)
    except OSError as exc:
        raise ChangeSetRefusedError("task", f"cannot open the task file: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ChangeSetRefusedError("task", "the task is not a regular file")
        data = os.read(fd, TASK_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > TASK_MAX:
        raise ChangeSetRefusedError("task_too_large", f"over {TASK_MAX} bytes")
    return data



def materialise(root: Path, files: list[remotepack.PackedFile]) -> None:
    """Write verified files under a new directory `root` (it must not exist):
    paths were checked (no `..`, absolute, `.git`, ...) and nothing but what
    is written here is in it, so no link can be on the way."""
    root.mkdir(parents=True)
    for item in files:
        target = root.joinpath(*item.path.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o755 if item.mode == 0o100755 else 0o644)
        try:
            write_all(fd, item.data)
        finally:
            os.close(fd)
