"""The wire form of what crosses hosts for a remote subagent. Pure.

A pack is the line `CRLPACK1`, a 4-byte big-endian header length, a JSON
header and the files' bytes, named by its SHA-256; every check runs before
anything is written. See docs/fleet.md ("Subagents on another host").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from actors.changesets import manifest as mf
from actors.changesets.paths import check_path
from actors.changesets.snapshot import BaseIndex
from broker.errors import ChangeSetRefusedError

MAGIC = b"CRLPACK1\n"
MODES = (0o100644, 0o100755)
SHA_HEX = frozenset("0123456789abcdef")
HEADER_MAX = 4 * 1024 * 1024  # the JSON header of one pack
MANIFEST_MAX = 256 * 1024  # a changeset.json (64 files' entries are far below)


@dataclass(frozen=True)
class PackLimits:
    """Bounds of one pack (a snapshot's defaults; a change set's come from its Limits)."""

    max_files: int = 10_000
    max_bytes: int = 32 * 1024 * 1024


@dataclass(frozen=True)
class PackedFile:
    path: str
    mode: int
    data: bytes


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(files: list[PackedFile]) -> bytes:
    header = json.dumps({"files": [[f.path, f.mode, len(f.data), sha256(f.data)]
                                   for f in files]}, separators=(",", ":")).encode()
    return b"".join([MAGIC, len(header).to_bytes(4, "big"), header, *(f.data for f in files)])


def _refuse(bound: str, detail: str, path: str | None = None) -> ChangeSetRefusedError:
    return ChangeSetRefusedError(bound, detail, path)


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= SHA_HEX


def unpack(blob: bytes, digest: str, limits: PackLimits) -> list[PackedFile]:
    """The files of a pack received from another host, every rule checked."""
    if len(blob) > limits.max_bytes + HEADER_MAX + len(MAGIC) + 4:
        raise _refuse("pack_too_large", f"{len(blob)} bytes over the bound {limits.max_bytes}")
    if not _is_sha(digest) or sha256(blob) != digest:
        raise _refuse("digest_mismatch", "the pack's SHA-256 is not the one announced")
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise _refuse("malformed_pack", "not a pack (magic)")
    start = len(MAGIC) + 4
    length = int.from_bytes(blob[len(MAGIC):start], "big")
    if length > HEADER_MAX or start + length > len(blob):
        raise _refuse("malformed_pack", f"header of {length} bytes")
    try:
        header = json.loads(blob[start:start + length])
    except ValueError as exc:
        raise _refuse("malformed_pack", "header is not JSON") from exc
    entries = header.get("files") if isinstance(header, dict) else None
    if not isinstance(entries, list):
        raise _refuse("malformed_pack", "header has no file list")
    if len(entries) > limits.max_files:
        raise _refuse("max_files", f"{len(entries)} files over the bound {limits.max_files}")
    offset = start + length
    files: list[PackedFile] = []
    seen: set[str] = set()
    total = 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and type(entry[1]) is int and type(entry[2]) is int and entry[2] >= 0
                and _is_sha(entry[3])):
            raise _refuse("malformed_pack", "a file entry is not [path, mode, size, sha256]")
        path, mode, size, digest_of = entry
        check_path(path)  # ChangeSetRefusedError unsafe_path: .., absolute, .git, .corral...
        if mode not in MODES:
            raise _refuse("special_file", f"mode {mode:o} (only regular files travel)", path)
        if path in seen:
            raise _refuse("malformed_pack", "a path named twice", path)
        seen.add(path)
        total += size
        if total > limits.max_bytes:
            raise _refuse("pack_too_large", f"files over the bound {limits.max_bytes}", path)
        data = blob[offset:offset + size]
        if len(data) != size or sha256(data) != digest_of:
            raise _refuse("digest_mismatch", "a file's bytes do not match its entry", path)
        offset += size
        files.append(PackedFile(path, mode, data))
    if offset != len(blob):
        raise _refuse("malformed_pack", f"{len(blob) - offset} bytes after the last file")
    for path in seen:  # a file that is also another one's directory
        parts = path.split("/")
        for cut in range(1, len(parts)):
            if "/".join(parts[:cut]) in seen:
                raise _refuse("malformed_pack", "a path is both a file and a directory", path)
    return files


# --- the snapshot going out --------------------------------------------------------
def snapshot_files(index: BaseIndex) -> tuple[list[PackedFile], int]:
    """The regular files of a local snapshot's base (the pack's order: sorted),
    and how many symlinks were left out (they never travel)."""
    files = []
    links = 0
    for path in sorted(index.entries):
        entry = index.entries[path]
        if entry.mode not in MODES:
            links += 1
            continue
        files.append(PackedFile(path, entry.mode, index.content(path)))
    return files, links


def base_digest(files: list[PackedFile]) -> str:
    """The digest `BaseIndex.digest()` gives for a base of exactly these files:
    what the child's manifest must name as its `base_sha256`."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{sha256(f.data)}\0{f.mode:o}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


# --- the change set coming back ------------------------------------------------------
def changeset_files(manifest_bytes: bytes, patch: bytes | None,
                    blobs: dict[str, bytes]) -> list[PackedFile]:
    files = [PackedFile(mf.MANIFEST, 0o100644, manifest_bytes)]
    if patch is not None:
        files.append(PackedFile(mf.PATCH, 0o100644, patch))
    files += [PackedFile(f"{mf.BLOBS}/{name}", 0o100644, data)
              for name, data in sorted(blobs.items())]
    return files


def changeset_limits(limits: mf.Limits) -> PackLimits:
    """The most a well-formed change set within `limits` can weigh."""
    return PackLimits(max_files=limits.max_files + 2,
                      max_bytes=MANIFEST_MAX + limits.max_patch_bytes + limits.max_input_bytes)


@dataclass(frozen=True)
class VerifiedChangeSet:
    manifest: mf.Manifest
    manifest_bytes: bytes
    patch: bytes | None
    blobs: dict[str, bytes]  # sha256 -> content


def verify_changeset(
        blob: bytes, digest: str, *, changeset_id: str, base: dict[str, tuple[str, int]],
        base_sha256: str, limits: mf.Limits) -> VerifiedChangeSet:
    """A change set from another host, checked as if built here against `base`
    (path -> (sha256, mode) of the snapshot that was sent)."""
    files = {f.path: f.data for f in unpack(blob, digest, changeset_limits(limits))}
    raw = files.pop(mf.MANIFEST, None)
    if raw is None or len(raw) > MANIFEST_MAX:
        raise _refuse("malformed_changeset", "no manifest, or one over its bound")
    try:
        manifest = mf.Manifest.model_validate_json(raw)
    except ValueError as exc:
        raise _refuse("malformed_changeset", "the manifest does not parse") from exc
    if manifest.changeset_id != changeset_id:
        raise _refuse("foreign_changeset", f"names {manifest.changeset_id[:40]!r}, "
                      f"expected {changeset_id}")
    if manifest.base_sha256 != base_sha256:
        raise _refuse("foreign_changeset", "built on another base than the snapshot sent")
    patch = files.pop(mf.PATCH, None)
    blobs = {path.removeprefix(f"{mf.BLOBS}/"): data for path, data in files.items()
             if path.startswith(f"{mf.BLOBS}/") and path.count("/") == 1}
    if len(blobs) != len(files):
        raise _refuse("malformed_changeset", "a file that is neither manifest, patch nor blob")
    if manifest.status == "refused":
        if patch is not None or blobs or manifest.refusal is None:
            raise _refuse("malformed_changeset", "a refused set with a patch or blobs")
        return VerifiedChangeSet(manifest, raw, None, {})
    if len(manifest.files) > limits.max_files:
        raise _refuse("max_files", f"{len(manifest.files)} files over {limits.max_files}")
    if patch is None or manifest.patch_sha256 != sha256(patch) \
            or manifest.patch_bytes != len(patch):
        raise _refuse("digest_mismatch", "the patch is not the one the manifest names")
    if len(patch) > limits.max_patch_bytes:
        raise _refuse("max_patch_bytes", f"{len(patch)} over {limits.max_patch_bytes}")
    named: set[str] = set()
    input_bytes = 0
    paths: set[str] = set()
    for change in manifest.files:
        check_path(change.path)
        if change.path in paths:
            raise _refuse("malformed_changeset", "a path changed twice", change.path)
        paths.add(change.path)
        before = base.get(change.path)
        if change.op == "add" and before is not None:
            raise _refuse("foreign_changeset", "an add of a path the base has", change.path)
        if change.op != "add" and (before is None or before[0] != change.before_sha256):
            raise _refuse("foreign_changeset", "a before-hash that is not the base's",
                          change.path)
        if change.op == "delete":
            if change.after_sha256 is not None:
                raise _refuse("malformed_changeset", "a delete with content", change.path)
        else:
            if change.after_mode not in MODES or not _is_sha(change.after_sha256):
                raise _refuse("special_file", "an after-state that is not a regular file",
                              change.path)
            data = blobs.get(str(change.after_sha256))
            if data is None or len(data) != change.after_size:
                raise _refuse("digest_mismatch", "its blob is missing or of another size",
                              change.path)
            named.add(str(change.after_sha256))
        input_bytes += change.before_size + change.after_size
    if set(blobs) != named or any(sha256(d) != name for name, d in blobs.items()):
        raise _refuse("digest_mismatch", "blobs other than the manifest names")
    if input_bytes > limits.max_input_bytes or manifest.input_bytes != input_bytes:
        raise _refuse("max_input_bytes", f"{input_bytes} over {limits.max_input_bytes}")
    return VerifiedChangeSet(manifest, raw, patch, blobs)
