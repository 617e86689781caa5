"""The on-disk format of one change set (version 1) and its one reader.

See docs/changesets.md ("Files", "The manifest (`changeset.json`,
version 1)").
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.durable import write_atomic
from broker.errors import ChangeSetRefusedError

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


class Seal(_Model):
    """What the WAL records of a set when it is built (the `subagent_ended`
    fact): apply refuses a set whose files no longer have these digests."""

    manifest_sha256: str  # of changeset.json's bytes as built
    patch_sha256: str | None
    blob_sha256: list[str]  # every blob, sorted

    @classmethod
    def of(cls, manifest: Manifest, data: bytes | None = None) -> Seal:
        """The seal of `manifest` (whose bytes are `data` when read from disk)."""
        return cls(manifest_sha256=sha256(encode(manifest) if data is None else data),
                   patch_sha256=manifest.patch_sha256,
                   blob_sha256=sorted({c.after_sha256 for c in manifest.files
                                       if c.after_sha256 is not None}))

    def as_fact(self) -> dict[str, object]:
        return {"manifest_sha256": self.manifest_sha256, "patch_sha256": self.patch_sha256,
                "blob_sha256": self.blob_sha256}

    @classmethod
    def from_fact(cls, payload: dict[str, object]) -> Seal | None:
        """The seal in a `subagent_ended` payload, None when it has none."""
        try:
            return cls.model_validate({k: payload[k] for k in
                                       ("manifest_sha256", "patch_sha256", "blob_sha256")})
        except (KeyError, ValueError):
            return None


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


def write_once(path: Path, data: bytes, *, read_only: bool = True,
               sync_dir: bool = True) -> None:
    """temp + fsync + rename + fsync(dir); read-only afterwards. Without
    `sync_dir` the rename is durable only once the caller fsyncs the
    directory (one fsync for many files, before what names them)."""
    write_atomic(path, data, read_only=read_only, sync_dir=sync_dir)


def encode(manifest: Manifest) -> bytes:
    """The manifest's bytes on disk (what its seal's digest is over)."""
    return manifest.model_dump_json(indent=1).encode()


def load(directory: Path) -> Manifest:
    return Manifest.model_validate_json((directory / MANIFEST).read_bytes())


def load_sealed(directory: Path, seal: Seal | None) -> Manifest:
    """The manifest, read once; with a seal, refused with bound `tampered`
    unless its bytes have the sealed digest."""
    data = (directory / MANIFEST).read_bytes()
    if seal is not None and sha256(data) != seal.manifest_sha256:
        raise ChangeSetRefusedError("tampered", f"{directory / MANIFEST} is not the manifest "
                                    "that was built (its digest differs from the WAL's)")
    return Manifest.model_validate_json(data)


def load_receipt(directory: Path) -> Receipt | None:
    try:
        return Receipt.model_validate_json((directory / RECEIPT).read_bytes())
    except FileNotFoundError:
        return None
