"""Applying a change set to the parent's workspace: once, all or nothing.

Steps checked, intent, file<N>, files, receipt, fact, done; after the intent
an apply is rolled forward, never back. See docs/changesets.md ("Applying
(`apply.py`)").
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.changesets.confined import NO_GUARD, Guard
from actors.changesets.manifest import (
    BLOBS,
    INTENT,
    PATCH,
    RECEIPT,
    Intent,
    Manifest,
    Receipt,
    ReceiptFile,
    Seal,
    load_receipt,
    load_sealed,
    write_once,
)
from actors.changesets.paths import check_path, delete_file, open_root, read_file, write_file
from broker.durable import fsync_dir
from broker.errors import ChangeSetRefusedError

FAULT_ENV = "CORRAL_APPLY_FAULT"  # a step name: SIGKILL this process right after it
Record = Callable[[str, dict[str, Any], str], None]  # (event, payload, idempotency key)


def _fault(step: str) -> None:
    if os.environ.get(FAULT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _hash(root_fd: int, path: str, guard: Guard = NO_GUARD) -> str | None:
    found = read_file(root_fd, path, guard)
    return hashlib.sha256(found[0]).hexdigest() if found is not None else None


def _verified(directory: Path, manifest: Manifest, seal: Seal | None) -> dict[str, bytes]:
    """The blobs, each read once and checked against its hash (and, with a
    seal, against the digests the WAL recorded when the set was built); the
    patch checked too. What is returned is what gets written."""
    if manifest.status != "ready" or manifest.patch_sha256 is None:
        raise ChangeSetRefusedError("not_ready", f"change set {manifest.changeset_id} is "
                                    f"{manifest.status}: only a ready set can be applied")
    bound = "tampered" if seal is not None else "damaged"
    if seal is not None and (seal.patch_sha256 != manifest.patch_sha256 or seal.blob_sha256
                             != sorted({c.after_sha256 for c in manifest.files
                                        if c.after_sha256 is not None})):
        raise ChangeSetRefusedError("tampered", "the manifest's digests differ from the WAL's")
    patch = (directory / PATCH).read_bytes()
    if hashlib.sha256(patch).hexdigest() != manifest.patch_sha256:
        raise ChangeSetRefusedError(bound, f"{directory / PATCH} does not match its manifest")
    blobs: dict[str, bytes] = {}
    for change in manifest.files:
        check_path(change.path)  # a manifest is re-read from disk: its paths too
        if change.after_sha256 is not None and change.after_sha256 not in blobs:
            data = (directory / BLOBS / change.after_sha256).read_bytes()
            if hashlib.sha256(data).hexdigest() != change.after_sha256:
                raise ChangeSetRefusedError(bound, f"blob of {change.path!r} is not the one "
                                            "that was built", change.path)
            blobs[change.after_sha256] = data
    return blobs


def workspace_digest(manifest: Manifest) -> str:
    h = hashlib.sha256()
    for c in sorted(manifest.files, key=lambda c: c.path):
        h.update(f"{c.path}\0{c.after_sha256}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def apply(directory: Path, workspace: Path, record: Record | None = None, *,
          seal: Seal | None = None, guard: Guard = NO_GUARD) -> Receipt:
    """Apply the set in `directory` to `workspace`; return the receipt.
    With `seal` (the digests the WAL recorded at build), a set whose manifest,
    patch or blobs changed since is refused with bound `tampered` before
    anything is written; `guard` names directories never to enter (the state
    directory). Raises ChangeSetRefusedError (tampered, stale,
    already_applied, not_ready, ...)."""
    manifest = load_sealed(directory, seal)
    if (directory / INTENT).exists():
        return _recover(directory, workspace, manifest, record, seal=seal, guard=guard)
    if load_receipt(directory) is not None:
        raise ChangeSetRefusedError("already_applied",
                                    f"change set {manifest.changeset_id} was applied already")
    blobs = _verified(directory, manifest, seal)
    with open_root(str(workspace)) as root_fd:
        for change in manifest.files:
            current = _hash(root_fd, change.path, guard)
            if current != change.before_sha256:
                raise ChangeSetRefusedError(
                    "stale", f"{change.path!r} changed since the snapshot "
                    f"(expected {change.before_sha256}, found {current})", change.path)
        _fault("checked")
        intent = Intent(changeset_id=manifest.changeset_id, patch_sha256=manifest.patch_sha256
                        or "", started_at=time.time())
        write_once(directory / INTENT, intent.model_dump_json().encode(), read_only=False)
        _fault("intent")
        _write_files(root_fd, manifest, blobs, recovering=False, guard=guard)
    return _finish(directory, manifest, record, recovered=False)


def _write_files(root_fd: int, manifest: Manifest, blobs: dict[str, bytes], *,
                 recovering: bool, guard: Guard) -> None:
    for n, change in enumerate(manifest.files):
        if recovering:
            current = _hash(root_fd, change.path, guard)
            if current == change.after_sha256:
                _fault(f"file{n}")
                continue
            if current != change.before_sha256:
                raise ChangeSetRefusedError(
                    "conflict", f"{change.path!r} is neither before nor after during recovery; "
                    "the intent is kept for the operator", change.path)
        if change.after_sha256 is None:
            delete_file(root_fd, change.path, guard)
        else:
            write_file(root_fd, change.path, blobs[change.after_sha256],
                       change.after_mode or 0o100644, guard)
        _fault(f"file{n}")
    _fault("files")


def _finish(directory: Path, manifest: Manifest, record: Record | None, *,
            recovered: bool) -> Receipt:
    receipt = load_receipt(directory)
    if receipt is None:
        receipt = Receipt(
            changeset_id=manifest.changeset_id, patch_sha256=manifest.patch_sha256 or "",
            task_sha256=manifest.task_sha256, workspace_sha256=workspace_digest(manifest),
            files=[ReceiptFile(path=c.path, after_sha256=c.after_sha256) for c in manifest.files],
            applied_at=time.time(), recovered=recovered,
        )
        write_once(directory / RECEIPT, receipt.model_dump_json(indent=1).encode())
    _fault("receipt")
    if record is not None:
        record("subagent_applied", {
            "changeset_id": manifest.changeset_id, "patch_sha256": receipt.patch_sha256,
            "workspace_sha256": receipt.workspace_sha256, "files": len(manifest.files),
        }, f"apply:{manifest.changeset_id}")
    _fault("fact")
    (directory / INTENT).unlink(missing_ok=True)
    fsync_dir(directory)
    _fault("done")
    return receipt


def _recover(directory: Path, workspace: Path, manifest: Manifest,
             record: Record | None, *, seal: Seal | None, guard: Guard) -> Receipt:
    if load_receipt(directory) is None:
        blobs = _verified(directory, manifest, seal)
        with open_root(str(workspace)) as root_fd:
            _write_files(root_fd, manifest, blobs, recovering=True, guard=guard)
    return _finish(directory, manifest, record, recovered=True)


def recover(directory: Path, workspace: Path, record: Record | None = None, *,
            seal: Seal | None = None, guard: Guard = NO_GUARD) -> Receipt | None:
    """Complete an interrupted apply (start-up); None when none was in progress."""
    if not (directory / INTENT).exists():
        return None
    return _recover(directory, workspace, load_sealed(directory, seal), record, seal=seal,
                    guard=guard)
