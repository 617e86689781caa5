"""The writer's checkpoint (`state/wal.checkpoint.json`) and the previous one.

Derived state naming only what is durable; start-up scans only what follows
it. See docs/wal.md ("Start-up").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError

from broker.durable import write_atomic

CHECKPOINT_VERSION = 2  # 2: ledger sizes and last seqs (an older one means a full scan)


class Checkpoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = CHECKPOINT_VERSION
    head_seq: int  # last durable seq (0: empty WAL)
    segment_first_seq: int  # the active segment
    offset: int  # end of the last durable record in that segment
    last_record_offset: int  # start of the record holding head_seq (-1: none)
    dedupe: dict[str, list[tuple[str, int]]]
    index_counts: dict[str, int]
    # Each ledger's size and last seq at this moment (all of it durable):
    # start-up checks only the ledger lines written after, and completes a
    # ledger from the WAL when the WAL holds later records of it.
    ledger_sizes: dict[str, int] = {}
    ledger_last_seq: dict[str, int] = {}
    # The storage epoch (actors/writer/retention.py) it was taken in: after a
    # compaction or truncation the offsets and index counts of an older one
    # may describe files that changed, so it is not used.
    storage_epoch: int = 0


def previous_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save(path: Path, checkpoint: Checkpoint) -> None:
    """Replace the checkpoint, keeping the one before it: when the WAL's tail
    is lost past the newest checkpoint, start-up can still begin from the
    previous one instead of scanning everything."""
    save_encoded(path, checkpoint.model_dump_json().encode())


_ENCODER = msgspec.json.Encoder()


def encode_fields(fields: dict[str, Any]) -> bytes:
    """The checkpoint the writer's own values make, as `Checkpoint(**fields)
    .model_dump_json()` would write it, byte for byte (tests/
    test_checkpoint_sync.py compares them), without the model: validating a
    hundred idempotency windows in pydantic held the GIL, and so the writer's
    loop, for 10-20 ms per checkpoint. The fields are named exactly as the
    model's (a KeyError or ValueError otherwise); `load` still validates."""
    names = list(Checkpoint.model_fields)
    given = set(fields) | {"version"}
    if given != set(names):
        raise ValueError(f"checkpoint fields {sorted(given ^ set(names))} do not match the model")
    values = {**fields, "version": CHECKPOINT_VERSION}
    return _ENCODER.encode({name: values[name] for name in names})


def save_encoded(path: Path, data: bytes) -> None:
    """`save` for a checkpoint already encoded (`encode_fields`)."""
    if path.exists():
        os.replace(path, previous_path(path))
    write_atomic(path, data)


def load(path: Path) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint, or (None, why not) when absent or unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, "absent"
    except OSError as exc:
        return None, f"unreadable: {exc}"
    try:
        checkpoint = Checkpoint.model_validate_json(raw)
    except (ValueError, ValidationError) as exc:
        return None, f"invalid: {str(exc)[:200]}"
    if checkpoint.version != CHECKPOINT_VERSION:
        return None, f"version {checkpoint.version} not {CHECKPOINT_VERSION}"
    return checkpoint, None
