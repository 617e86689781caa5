"""The on-disk format of one change set (version 1), in its directory
(`<session dir>/subagents/<id>/`):

    changeset.json    the manifest (`Manifest`): paths, before/after SHA-256 and
                      sizes, modes, the limits, the status (`ready` or `refused`,
                      with the bound that was hit), the patch's hash and size
    changes.patch     the git-format patch (only for a ready set)
    blobs/<sha256>    the after-content of every added or modified file (what
                      the applier writes; the patch renders the same change)
    application.json  the receipt (`Receipt`), written once by a successful apply
    apply.intent.json the write-ahead intent of an apply in progress

Every file is written to a temp name, fsynced, renamed and made read-only;
the manifest is written last, so its presence means the set is complete.
`load()` is the one reader (tests and tools share it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.durable import write_atomic

VERSION = 1
MANIFEST = "changeset.json"
PATCH = "changes.patch"
BLOBS = "blobs"
RECEIPT = "application.json"
INTENT = "apply.intent.json"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Limits(_Model):
    max_files: int = Field(default=64, ge=1)
    max_input_bytes: int = Field(default=256 * 1024, ge=1)  # before + after of changed files
    max_patch_bytes: int = Field(default=512 * 1024, ge=1)


class FileChange(_Model):
    path: str
    op: Literal["add", "modify", "delete"]
    before_sha256: str | None
    after_sha256: str | None
    before_size: int
    after_size: int
    before_mode: int | None
    after_mode: int | None
    binary: bool


class Refusal(_Model):
    bound: str  # max_files, max_input_bytes, max_patch_bytes, unsafe_path, symlink, ...
    detail: str
    path: str | None = None
    limit: int | None = None
    actual: int | None = None


class Manifest(_Model):
    version: Literal[1] = 1
    changeset_id: str
    status: Literal["ready", "refused"]
    created_at: float
    task_sha256: str | None = None
    base_sha256: str  # over the base index: which exact snapshot this is relative to
    limits: Limits
    files: list[FileChange]
    input_bytes: int
    patch_bytes: int
    patch_sha256: str | None
    refusal: Refusal | None = None


class ReceiptFile(_Model):
    path: str
    after_sha256: str | None


class Receipt(_Model):
    version: Literal[1] = 1
    changeset_id: str
    patch_sha256: str
    task_sha256: str | None
    workspace_sha256: str  # over the sorted (path, after hash) of every touched file
    files: list[ReceiptFile]
    applied_at: float
    recovered: bool  # completed by recovery after a crash mid-apply


class Intent(_Model):
    version: Literal[1] = 1
    changeset_id: str
    patch_sha256: str
    started_at: float


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_once(path: Path, data: bytes, *, read_only: bool = True) -> None:
    """temp + fsync + rename + fsync(dir); read-only afterwards."""
    write_atomic(path, data, read_only=read_only)


def load(directory: Path) -> Manifest:
    return Manifest.model_validate_json((directory / MANIFEST).read_bytes())


def load_receipt(directory: Path) -> Receipt | None:
    try:
        return Receipt.model_validate_json((directory / RECEIPT).read_bytes())
    except FileNotFoundError:
        return None
