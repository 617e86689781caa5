"""The packs that carry a remote subagent's snapshot out and its change set
back (actors/subagents/remotepack.py, docs/fleet.md "Subagents on another
host"): a pack round trips; every hostile pack (digest mismatch, over its
bounds, `..`, absolute, `.git`, symlink mode, a file that is also a
directory, bytes that do not match an entry) is refused with a typed bound
before anything is written; a change set built on "another host" verifies
against the base that was sent, and every forgery of it is refused. The
remote end and the host do not import each other."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from actors.changesets import manifest as mf
from actors.changesets.build import build
from actors.changesets.snapshot import snapshot
from actors.subagents import remotepack as rp
from actors.subagents.remote import OFFER_FILE, RemoteLink, clamp_usage, split_sender
from actors.subagents.transfers import TASK_MAX, Transfers, chunks, materialise, read_task
from broker import protocol
from broker.errors import ChangeSetRefusedError

LIMITS = rp.PackLimits(max_files=10, max_bytes=4096)


def _pack_of(entries: list[list[object]], datas: list[bytes]) -> bytes:
    header = json.dumps({"files": entries}).encode()
    return b"".join([rp.MAGIC, len(header).to_bytes(4, "big"), header, *datas])


def _bound(blob: bytes, limits: rp.PackLimits = LIMITS, digest: str | None = None) -> str:
    with pytest.raises(ChangeSetRefusedError) as info:
        rp.unpack(blob, digest or rp.sha256(blob), limits)
    return info.value.bound


def test_a_pack_round_trips_and_materialises(tmp_path: Path) -> None:
    files = [rp.PackedFile("a.txt", 0o100644, b"alpha\n"),
             rp.PackedFile("bin/run.sh", 0o100755, b"#!/bin/sh\n"),
             rp.PackedFile("empty", 0o100644, b"")]
    blob = rp.pack(files)
    assert rp.unpack(blob, rp.sha256(blob), LIMITS) == files
    materialise(tmp_path / "m", files)
    index = snapshot(tmp_path / "m", tmp_path / "base", tmp_path / "work")
    assert index.digest() == rp.base_digest(files)  # what the child's manifest will name
    assert (tmp_path / "work/bin/run.sh").stat().st_mode & 0o100


@pytest.mark.parametrize(("entry", "data", "bound"), [
    (["../escape", 0o100644, 1, None], b"x", "unsafe_path"),
    (["/etc/passwd", 0o100644, 1, None], b"x", "unsafe_path"),
    ([".git/hooks/post-checkout", 0o100755, 1, None], b"x", "unsafe_path"),
    (["a/./b", 0o100644, 1, None], b"x", "unsafe_path"),
    (["link", 0o120000, 1, None], b"x", "special_file"),
    (["ok", 0o100644, 1, "0" * 64], b"x", "digest_mismatch"),  # bytes not the entry's
    (["ok", 0o100644, 2, None], b"x", "digest_mismatch"),  # shorter than said
    (["ok", "644", 1, None], b"x", "malformed_pack"),
])
def test_a_hostile_snapshot_entry_is_refused(entry: list[object], data: bytes,
                                             bound: str) -> None:
    if entry[3] is None:
        entry[3] = hashlib.sha256(data).hexdigest()
    assert _bound(_pack_of([entry], [data])) == bound


def test_pack_level_forgeries_are_refused() -> None:
    good = rp.pack([rp.PackedFile("a", 0o100644, b"a")])
    assert _bound(good, digest="f" * 64) == "digest_mismatch"
    assert _bound(good + b"extra") == "malformed_pack"  # (its own digest: trailing bytes)
    assert _bound(b"NOTAPACK" + good) == "malformed_pack"
    many = rp.pack([rp.PackedFile(f"f{i}", 0o100644, b"") for i in range(11)])
    assert _bound(many) == "max_files"
    big = rp.pack([rp.PackedFile("big", 0o100644, b"x" * 5000)])
    assert _bound(big) == "pack_too_large"
    twice = rp.pack([rp.PackedFile("a", 0o100644, b"1"), rp.PackedFile("a", 0o100644, b"2")])
    assert _bound(twice) == "malformed_pack"
    both = rp.pack([rp.PackedFile("a", 0o100644, b"1"), rp.PackedFile("a/b", 0o100644, b"2")])
    assert _bound(both) == "malformed_pack"


def test_transfers_join_chunks_and_refuse_what_does_not_fit() -> None:
    blob = bytes(range(256)) * 5000  # 1.28 MB: three chunks
    parts = chunks(blob)
    assert len(parts) == 3
    transfers = Transfers(max_bytes=2 * 1024 * 1024)
    for part in reversed(parts):  # any order
        assert transfers.take("hb", parts[0].pack_sha256) is None
        assert transfers.add("hb", part) is None
    assert transfers.take("hc", parts[0].pack_sha256) is None  # another host's: not joined
    assert transfers.take("hb", parts[0].pack_sha256) == blob
    assert transfers.take("hb", parts[0].pack_sha256) is None  # taken once
    small = Transfers(max_bytes=1024)
    assert small.add("hb", parts[0]) is not None  # over the bound: refused at once
    lying = protocol.SubagentChunk(pack_sha256=parts[0].pack_sha256, pack_bytes=len(blob),
                                   index=2, total=3, data=b"short")
    assert transfers.add("hb", lying) is not None


def test_transfers_stay_bounded_in_bytes_and_count() -> None:
    transfers = Transfers(max_bytes=1000)
    for i in range(40):  # a host sending many packs it never finishes
        data = bytes([i]) * 900
        digest = rp.sha256(data)
        assert transfers.add("hc", protocol.SubagentChunk(
            pack_sha256=digest, pack_bytes=900, index=0, total=1, data=data)) is None
    assert sum(t.size for t in transfers._open.values()) <= 2000
    assert transfers.take("hc", digest) == data  # the newest is kept


def test_placement_is_refused_unless_fleet_mode_allows_it() -> None:
    owner: Any = SimpleNamespace(limits=mf.Limits())
    off = RemoteLink(owner, None, True, rp.PackLimits())
    assert off.placement(None) is None
    assert _refused(lambda: off.placement("hb")) == "remote_off"  # not in fleet mode
    closed = RemoteLink(owner, "ha", False, rp.PackLimits())
    assert closed.placement("ha") is None  # this host: a local child
    assert _refused(lambda: closed.placement("hb")) == "remote_off"
    link = RemoteLink(owner, "ha", True, rp.PackLimits())
    assert link.placement("hb") == "hb"
    assert _refused(lambda: link.placement("auto")) == "placement"  # not built


@pytest.mark.parametrize("backend", ["replay", "pipeline"])
def test_a_child_from_another_host_may_not_read_this_hosts_streams_by_name(
        backend: str) -> None:
    """`replay` replays a stream of this host and `pipeline` runs a run file
    of it, both named by the offer: refused before any chunk is looked at
    (none was sent here: a check after the chunks would answer "incomplete")."""
    owner: Any = SimpleNamespace(limits=mf.Limits())
    link = RemoteLink(owner, "hb", True, rp.PackLimits())
    offer = protocol.SubagentRemote(
        msg_id="m-1", op="offer", subagent_id="s-0123456789ab", parent="p1",
        pack_sha256="0" * 64, base_sha256="0" * 64, task=b"steps: []",
        settings=b"{}", backend=backend)  # type: ignore[arg-type]
    origin = split_sender("ha:subagents")
    assert origin == "ha"
    assert _refused(lambda: link._host_child(origin, offer)) == "backend_refused"


# --- change sets built elsewhere -------------------------------------------------------
def _built(tmp_path: Path) -> tuple[bytes, dict[str, tuple[str, int]], str, str]:
    """A change set built as host B does (a pack), the base A sent, its digest, the id."""
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src/app.py").write_text("def greet():\n    return 'hi'\n")
    (ws / "gone.txt").write_text("bye\n")
    base_files, _ = rp.snapshot_files(snapshot(ws, tmp_path / "a-base", tmp_path / "a-work"))
    materialise(tmp_path / "b-in", base_files)
    b_dir = tmp_path / "b"
    index = snapshot(tmp_path / "b-in", b_dir / "base", b_dir / "work")
    (b_dir / "work/src/app.py").write_text("def welcome():\n    return 'hi'\n")
    (b_dir / "work/new.md").write_text("new\n")
    (b_dir / "work/gone.txt").unlink()
    cid = "s-0123456789ab"  # the parent's host's id (host B builds with it)
    manifest = build(cid, index, b_dir / "work", b_dir, limits=mf.Limits())
    assert manifest.status == "ready"
    blobs = {c.after_sha256: (b_dir / mf.BLOBS / c.after_sha256).read_bytes()
             for c in manifest.files if c.after_sha256}
    blob = rp.pack(rp.changeset_files((b_dir / mf.MANIFEST).read_bytes(),
                                      (b_dir / mf.PATCH).read_bytes(), blobs))
    base = {f.path: (rp.sha256(f.data), f.mode) for f in base_files}
    return blob, base, rp.base_digest(base_files), cid


def _verify(blob: bytes, base: dict[str, tuple[str, int]], digest: str, cid: str,
            limits: mf.Limits | None = None) -> rp.VerifiedChangeSet:
    return rp.verify_changeset(blob, rp.sha256(blob), changeset_id=cid, base=base,
                               base_sha256=digest, limits=limits or mf.Limits())


def _repacked(blob: bytes, change: dict[str, bytes | None]) -> bytes:
    files = {f.path: f.data for f in rp.unpack(blob, rp.sha256(blob), rp.PackLimits())}
    for path, data in change.items():
        if data is None:
            files.pop(path, None)
        else:
            files[path] = data
    return rp.pack([rp.PackedFile(p, 0o100644, d) for p, d in files.items()])


def _refused(call: object) -> str:
    with pytest.raises(ChangeSetRefusedError) as info:
        call()  # type: ignore[operator]
    return info.value.bound


def test_a_change_set_from_another_host_verifies_and_forgeries_are_refused(
        tmp_path: Path) -> None:
    blob, base, digest, cid = _built(tmp_path)
    verified = _verify(blob, base, digest, cid)
    assert {(c.path, c.op) for c in verified.manifest.files} == {
        ("src/app.py", "modify"), ("new.md", "add"), ("gone.txt", "delete")}
    manifest = json.loads(verified.manifest_bytes)

    def forged(**fields: object) -> bytes:
        return _repacked(blob, {mf.MANIFEST: json.dumps({**manifest, **fields}).encode()})

    some_blob = next(p for p in (f.path for f in rp.unpack(blob, rp.sha256(blob),
                                                           rp.PackLimits()))
                     if p.startswith("blobs/"))
    cases = {
        "bad digest": lambda: rp.verify_changeset(
            blob, "0" * 64, changeset_id=cid, base=base, base_sha256=digest,
            limits=mf.Limits()),
        "another child": lambda: _verify(blob, base, digest, "s-ffffffffffff"),
        "another base": lambda: _verify(blob, base, "1" * 64, cid),
        "patch swapped": lambda: _verify(_repacked(blob, {mf.PATCH: b"diff --git evil\n"}),
                                         base, digest, cid),
        "blob swapped": lambda: _verify(_repacked(blob, {some_blob: b"evil\n"}),
                                        base, digest, cid),
        "blob missing": lambda: _verify(_repacked(blob, {some_blob: None}), base, digest, cid),
        "extra file": lambda: _verify(_repacked(blob, {"blobs/" + "e" * 64: b"x"}),
                                      base, digest, cid),
        "hook planted": lambda: _verify(_repacked(blob, {".git/hooks/pre-commit": b"x"}),
                                        base, digest, cid),
        "path escapes": lambda: _verify(forged(files=[
            {**manifest["files"][0], "path": "../../etc/cron.d/x"}]), base, digest, cid),
        "before not the base's": lambda: _verify(forged(files=[
            {**f, "before_sha256": "2" * 64} if f["op"] == "modify" else f
            for f in manifest["files"]]), base, digest, cid),
        "over max_files": lambda: _verify(blob, base, digest, cid, mf.Limits(max_files=2)),
        "over max_patch_bytes": lambda: _verify(blob, base, digest, cid,
                                                mf.Limits(max_patch_bytes=10)),
        "input bytes understated": lambda: _verify(forged(input_bytes=1), base, digest, cid),
        "no manifest": lambda: _verify(_repacked(blob, {mf.MANIFEST: None}), base, digest, cid),
        "manifest not json": lambda: _verify(_repacked(blob, {mf.MANIFEST: b"{"}),
                                             base, digest, cid),
    }
    bounds = {name: _refused(call) for name, call in cases.items()}
    assert bounds == {
        "bad digest": "digest_mismatch", "another child": "foreign_changeset",
        "another base": "foreign_changeset", "patch swapped": "digest_mismatch",
        "blob swapped": "digest_mismatch", "blob missing": "digest_mismatch",
        "extra file": "digest_mismatch", "hook planted": "unsafe_path",
        "path escapes": "unsafe_path", "before not the base's": "foreign_changeset",
        "over max_files": "max_files", "over max_patch_bytes": "max_patch_bytes",
        "input bytes understated": "max_input_bytes", "no manifest": "malformed_changeset",
        "manifest not json": "malformed_changeset",
    }
    oversized = rp.pack([rp.PackedFile("blobs/" + "a" * 64, 0o100644, b"x" * (2 << 20))])
    assert _refused(lambda: _verify(oversized, base, digest, cid)) == "pack_too_large"


def test_the_task_file_is_read_bounded_and_only_if_regular(tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("steps: []\n")
    assert read_task(tmp_path / "task.yaml") == b"steps: []\n"
    (tmp_path / "big.yaml").write_bytes(b"#" * (TASK_MAX + 1))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "task.yaml")
    bounds = {}
    for name in ("big.yaml", "fifo", "link.yaml", "absent.yaml"):
        with pytest.raises(ChangeSetRefusedError) as info:
            read_task(tmp_path / name)
        bounds[name] = info.value.bound
    assert bounds == {"big.yaml": "task_too_large", "fifo": "task", "link.yaml": "task",
                      "absent.yaml": "task"}
    with pytest.raises(ChangeSetRefusedError):
        read_task(Path("/dev/zero"))  # never read without end


def test_a_remote_host_cannot_charge_more_than_the_budget_it_was_sent(tmp_path: Path) -> None:
    (tmp_path / OFFER_FILE).write_text(json.dumps(
        {"settings": {"budget": {"tokens": 1000, "cost_units": 2.5}}}))
    assert clamp_usage(tmp_path, 10**12, 1e9) == (1000, 2.5)
    assert clamp_usage(tmp_path, 10, 0.5) == (10, 0.5)
    (tmp_path / OFFER_FILE).write_text(json.dumps(
        {"settings": {"budget": {"tokens": None, "cost_units": None}}}))
    assert clamp_usage(tmp_path, 10**12, 1e9) == (10**12, 1e9)  # unbounded stays so


def test_the_subagents_actor_gets_remote_children_only_when_the_config_says() -> None:
    from supervisor.fleetconfig import FleetConfig

    assert FleetConfig().subagents_args() == []  # one host on its own
    urls = ["nats://127.0.0.1:4222"]
    assert FleetConfig(host="h1", urls=urls).subagents_args() == ["--fleet-host", "h1"]
    assert FleetConfig(host="h1", urls=urls, remote_subagents=True).subagents_args() == [
        "--fleet-host", "h1", "--remote-subagents"]


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, in any statement (functions and
    TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_host_and_its_remote_end_do_not_import_each_other() -> None:
    package = Path(__file__).resolve().parent.parent / "actors" / "subagents"
    assert "actors.subagents.remote" in _imports(package / "host.py")  # (the check sees)
    assert not {m for m in _imports(package / "remote.py") if m.startswith(
        "actors.subagents.host")}
