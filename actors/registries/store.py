"""Config generations: the registries' on-disk truth, and the one way to change them.

The content is durable before the WAL fact that names it; `at(seq)` and
`restore_registries` serve rewind. See docs/registries.md ("Generations on
disk", "Restore").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog
import yaml
from pydantic import ValidationError

from actors.registries import schemas
from actors.registries.base import Entry
from actors.registries.entries import HookEntry, McpServerEntry, ScheduleEntry
from broker.errors import CorralError
from broker.statedir import StateDir

STREAM = "config/registries"
EVENT = "config_generation"
VERSION = 1
log = structlog.get_logger("registries")


class RegistryError(CorralError):
    """A registry change refused (no such entry, invalid entry) or a generation
    on disk that cannot be read (the file and why)."""


@dataclass(frozen=True)
class Generation:
    registry: schemas.RegistryName
    seq: int  # the seq of the fact that names it; 0: the empty start
    entries: list[dict[str, Any]] = field(default_factory=list)
    key: str = ""
    op: str = ""
    actor: str = ""
    sha256: str = ""

    def names(self) -> list[str]:
        return [str(e["name"]) for e in self.entries]

    def get(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.entries if e["name"] == name), None)


def directory(state_dir: StateDir, registry: str) -> Path:
    return state_dir.config_dir / "generations" / registry


def yaml_path(state_dir: StateDir, registry: str) -> Path:
    return state_dir.config_dir / f"{registry}.yaml"


def _check(registry: str) -> schemas.RegistryName:
    if registry not in schemas.REGISTRIES:
        raise RegistryError(f"no registry {registry!r} (registries: "
                            f"{', '.join(schemas.REGISTRIES)})")
    return registry


def _seqs(state_dir: StateDir, registry: str) -> list[int]:
    try:
        names = os.listdir(directory(state_dir, registry))
    except FileNotFoundError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _read(path: Path, registry: schemas.RegistryName, seq: int) -> Generation:
    try:
        data = path.read_bytes()
        body = json.loads(data)
        entries = [schemas.entry(registry, e).model_dump() for e in body["entries"]]
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        raise RegistryError(f"{path}: unreadable generation: {exc}") from exc
    if body.get("version") != VERSION or body.get("registry") != registry:
        raise RegistryError(f"{path}: not a generation of {registry}")
    return Generation(registry, seq, entries, str(body.get("key", "")), str(body.get("op", "")),
                      str(body.get("actor", "")), hashlib.sha256(data).hexdigest())


def at(state_dir: StateDir, registry: str, seq: int | None = None) -> Generation:
    """The generation in force at `seq` (None: the newest)."""
    name = _check(registry)
    seqs = [s for s in _seqs(state_dir, name) if seq is None or s <= seq]
    if not seqs:
        return Generation(name, 0)
    return _read(directory(state_dir, name) / f"{seqs[-1]:020d}.json", name, seqs[-1])


def newest(state_dir: StateDir, registry: str) -> Generation:
    return at(state_dir, registry, None)


def newest_seq(state_dir: StateDir, registry: str) -> int:
    """The seq of the newest generation (0: none yet): a reader re-reads when it moves."""
    seqs = _seqs(state_dir, _check(registry))
    return seqs[-1] if seqs else 0


E = TypeVar("E", bound=Entry)


def _models(state_dir: StateDir, registry: str, model: type[E]) -> dict[str, E]:
    return {str(e["name"]): model.model_validate(e)
            for e in newest(state_dir, registry).entries}


def load_schedules(state_dir: StateDir) -> dict[str, ScheduleEntry]:
    """The schedules in force (raises RegistryError when the newest generation
    cannot be read)."""
    return _models(state_dir, "schedules", ScheduleEntry)


def load_hooks(state_dir: StateDir) -> dict[str, HookEntry]:
    return _models(state_dir, "hooks", HookEntry)


def load_mcp(state_dir: StateDir) -> dict[str, McpServerEntry]:
    return _models(state_dir, "mcp", McpServerEntry)


def pipeline_source(state_dir: StateDir, target: str) -> tuple[str, str]:
    """(text, source) of a pipeline file, or else of the installed pipeline
    named `target` (raises LookupError naming what is installed)."""
    path = Path(target)
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path.resolve())
    gen = newest(state_dir, "pipelines")
    entry = gen.get(target)
    if entry is None:
        raise LookupError(f"no pipeline file or installed pipeline {target!r} "
                          f"(installed: {', '.join(gen.names()) or 'none'})")
    return str(entry["text"]), f"registry:{target}@{gen.seq}"


def history(state_dir: StateDir, registry: str) -> list[Generation]:
    name = _check(registry)
    return [_read(directory(state_dir, name) / f"{s:020d}.json", name, s)
            for s in _seqs(state_dir, name)]


@contextlib.contextmanager
def _locked(state_dir: StateDir, registry: str) -> Iterator[None]:
    folder = directory(state_dir, registry)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def materialise(state_dir: StateDir, registry: str) -> Path:
    """Rewrite `config/<registry>.yaml` from the newest generation (derived: any
    reader may trust the generations instead)."""
    gen = newest(state_dir, registry)
    doc = {"registry": gen.registry, "generation_seq": gen.seq, "entries": gen.entries}
    path = yaml_path(state_dir, registry)
    _write_durably(path, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode())
    return path


def _reconcile(state_dir: StateDir, registry: schemas.RegistryName, writer: Any) -> None:
    """Name every pending file its fact names; remove those no fact names."""
    folder = directory(state_dir, registry)
    pending = {n[len("pending-"):-5]: folder / n for n in os.listdir(folder)
               if n.startswith("pending-") and n.endswith(".json")}
    if not pending:
        return
    seqs = _seqs(state_dir, registry)
    for record in writer.read_stream(STREAM, (seqs[-1] + 1) if seqs else 1):
        payload = record.payload()
        if (record.event == EVENT and isinstance(payload, dict)
                and payload.get("registry") == registry and payload.get("sha256") in pending):
            pending.pop(payload["sha256"]).replace(folder / f"{record.seq:020d}.json")
            log.info("config_generation_named", registry=registry, seq=record.seq)
    for path in pending.values():
        path.unlink(missing_ok=True)
        log.warning("config_generation_dropped", registry=registry, file=path.name,
                    reason="no fact names it (a change cut before its append)")
    _fsync_dir(folder)


Change = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def commit(state_dir: StateDir, writer: Any, registry: str, change: Change, *, key: str,
           op: str, actor: str) -> tuple[Generation, bool]:
    """Apply `change` to the newest entries and record the result as a new
    generation; returns it and whether it is new (False: `key` was already
    committed). `change` raises RegistryError to refuse."""
    name = _check(registry)
    with _locked(state_dir, name):
        _reconcile(state_dir, name, writer)
        current = newest(state_dir, name)
        if key and current.key == key:
            return current, False
        try:
            entries = [schemas.entry(name, e).model_dump() for e in change(current.entries)]
        except ValidationError as exc:
            raise RegistryError(f"invalid {name} entry: {exc.errors()[0]['msg']}") from exc
        names = [e["name"] for e in entries]
        if len(set(names)) != len(names):
            raise RegistryError(f"{name}: two entries have the same name")
        body = {"version": VERSION, "registry": name, "entries": entries, "key": key,
                "op": op, "actor": actor, "parent_seq": current.seq}
        data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        sha = hashlib.sha256(data).hexdigest()
        folder = directory(state_dir, name)
        pending = folder / f"pending-{sha}.json"
        _write_durably(pending, data)
        ok = writer.append(STREAM, EVENT, {"registry": name, "sha256": sha, "op": op,
                                           "actor": actor, "parent_seq": current.seq,
                                           "entries": len(entries)}, key=key)
        if ok.duplicate:  # made before under this key, and changed since: not again
            pending.unlink(missing_ok=True)
            return at(state_dir, name, ok.seq), False
        pending.replace(folder / f"{ok.seq:020d}.json")
        _fsync_dir(folder)
        materialise(state_dir, name)
        log.info("config_generation_written", registry=name, seq=ok.seq, op=op, actor=actor)
        return Generation(name, ok.seq, entries, key, op, actor, sha), True


def restore_registries(state_dir: StateDir, writer: Any, seq: int, *,
                       actor: str = "operator", key_prefix: str = "",
                       changed_by: str | None = None) -> list[Generation]:
    """Make every registry's content at `seq` its newest content again, as a new
    generation (old generations stay); registries already equal are left
    alone. With `changed_by` (a session's agent, for its rewind), only the
    registries that actor changed after `seq` are restored. Returns the
    generations written."""
    written = []
    for registry in schemas.REGISTRIES:
        if changed_by is not None and not any(
                g.seq > seq and g.actor == changed_by for g in history(state_dir, registry)):
            continue
        target = at(state_dir, registry, seq)
        if newest(state_dir, registry).entries == target.entries:
            continue
        key = f"{key_prefix or 'restore'}:{registry}:{seq}:{newest(state_dir, registry).seq}"

        def back(_current: list[dict[str, Any]], entries: list[dict[str, Any]]
                 = target.entries) -> list[dict[str, Any]]:
            return entries

        gen, _ = commit(state_dir, writer, registry, back, key=key[:128],
                        op=f"restore@{seq}", actor=actor)
        written.append(gen)
    return written
