"""An agent's bundle is self-sufficient (docs/fleet.md, "Adoption";
supervisor/fleet/bundle.py): a host's tree store keeps an object once, in the
pack of the agent that stored it first, so an agent whose files share
contents with another's lacks them in its own pack; the uploader adds them to
its bundle as extras, and an adopter restores the agent's newest tree from
that bundle alone, adopted first or without the other agent. Incremental: a
later round uploads only the objects of the new tree the bundle lacks. On the
real 3-node cluster; the host's WAL and packs are real files (written by the
real capturer and the WAL's encoder)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from actors.kernel.settings import AgentSpec, write_spec
from actors.trees.recorder import capturer_for
from actors.trees.restore import restore
from actors.trees.store import packs_dir
from broker.statedir import StateDir
from supervisor.fleet.adopt import (
    OBJECTS,
    Uploader,
    _names,
    cut,
    download_extras,
    download_pack,
    take_bundle,
)
from tests.agentkit import FakeWriter, tree
from tests.fleetkit import Cluster, forget_hosts
from tests.test_trees_collect import dump_wal

pytestmark = [pytest.mark.fleet]

SHARED = 20  # files both agents hold with the same bytes
SHARED_SIZE = 1000


def fill(workspace: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = workspace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def records_of(writer: FakeWriter) -> list[dict[str, Any]]:
    """The records as the adopter reads them from the dead host's stream."""
    return [{"seq": r.seq, "stream": r.stream, "event": r.event, "payload": json.loads(r.body)}
            for r in writer.records]


def test_an_agent_sharing_contents_is_adopted_alone_with_its_newest_tree(
        fleet_cluster: Cluster, state_dir: StateDir, tmp_path: Path) -> None:
    import nats

    fleet_cluster.wait_ready()
    host = f"hb{uuid.uuid4().hex[:6]}"
    task = tmp_path / "task.yaml"
    task.write_text("steps: []\n")
    shared = {f"vendor/lib{i}.py": f"# shared {i}\n".ljust(SHARED_SIZE, "x")
              for i in range(SHARED)}
    shared |= {"README.md": "the common readme\n", "empty": ""}
    zed_files = {**shared, "zed.txt": "zed's own\n"}
    amy_files = {**shared, "amy.txt": "amy's own\n"}
    writer = FakeWriter()
    workspaces: dict[str, Path] = {}
    trees_of: dict[str, str] = {}
    streams: dict[str, tuple[list[dict[str, Any]], dict[str, str]]] = {}

    def capture(agent: str, files: dict[str, str], turn: int) -> None:
        workspace = workspaces.setdefault(agent, tmp_path / "ws" / agent)
        fill(workspace, files)
        digest = capturer_for(state_dir, agent, workspace).capture().digest
        writer.append(f"agent/{agent}", "workspace_tree", {"turn": turn, "tree": digest},
                      key=f"{agent}:w{turn}:tree")
        trees_of[agent] = digest

    for agent in ("amy", "abe", "zed"):
        write_spec(state_dir, agent, AgentSpec(task=str(task)))
    # zed stores first: the shared objects go to its pack; amy's pack holds its own
    # file and its trees; abe's workspace is zed's exactly: it stores nothing at all
    capture("zed", zed_files, 0)
    capture("amy", amy_files, 0)
    capture("abe", zed_files, 0)
    dump_wal(state_dir, writer)
    packs = packs_dir(state_dir.root)
    amy_pack = (packs / "amy.pack").stat().st_size
    assert not (packs / "abe.pack").exists()
    uploader = Uploader(host, state_dir, 3)

    async def bundle(js: Any, agent: str) -> tuple[bytes, bytes]:
        bucket = await js.object_store(OBJECTS)
        names = await _names(bucket)
        return (await download_pack(bucket, names, host, agent),
                await download_extras(bucket, names, host, agent))

    def adopt_alone(agent: str, at: str, pack: bytes, extras: bytes, where: Path
                    ) -> dict[str, str]:
        """What an adopter holding nothing else restores of the agent from its
        bundle as uploaded at round `at` (and its host's stream as it was then)."""
        adopter_packs = where / "trees" / "packs"
        adopter_packs.mkdir(parents=True)
        store = take_bundle(adopter_packs, agent, pack, extras)
        records, newest = streams[at]
        chosen = cut(records, agent, store)
        assert chosen.tree == newest[agent], (agent, chosen.tree, newest[agent])
        workspace = where / "workspace"
        workspace.mkdir()
        restore(workspace, store, None, chosen.tree)
        return tree(workspace)

    async def go() -> dict[str, Any]:
        nc: Any = await nats.connect(fleet_cluster.urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            seen: dict[str, Any] = {}
            assert await uploader.sync(js) == 3
            streams["round1"] = (records_of(writer), dict(trees_of))
            seen["round1"] = (uploader.uploaded_bytes, uploader.extra_bytes)
            for agent in ("amy", "abe"):
                seen[f"{agent}1"] = await bundle(js, agent)
            assert await uploader.sync(js) == 0  # nothing changed: nothing uploaded
            # the next turn: zed stores a new file first, amy the same bytes after it,
            # and amy changes its own file (in its own pack)
            capture("zed", {"new.txt": "a file both get\n"}, 1)
            capture("amy", {"new.txt": "a file both get\n", "amy.txt": "amy's own, v2\n"}, 1)
            dump_wal(state_dir, writer)
            before = (uploader.uploaded_bytes, uploader.extra_bytes)
            assert await uploader.sync(js) == 2  # zed's pack grew; amy's pack and extras
            streams["round2"] = (records_of(writer), dict(trees_of))
            seen["round2"] = (uploader.uploaded_bytes - before[0],
                              uploader.extra_bytes - before[1])
            seen["amy2"] = await bundle(js, "amy")
            return seen
        finally:
            await nc.close()

    try:
        seen = asyncio.run(go())
    finally:
        forget_hosts(fleet_cluster.urls, [host])
    # adopted alone (no zed pack on the adopter): amy's and abe's newest trees, whole
    pack, extras = seen["amy1"]
    assert len(pack) == amy_pack and extras  # its own pack as it is, and the extras
    assert adopt_alone("amy", "round1", pack, extras, tmp_path / "adopter1") == amy_files
    pack, extras = seen["abe1"]
    assert pack == b"" and extras
    assert adopt_alone("abe", "round1", pack, extras, tmp_path / "adopter2") == zed_files
    # the second round added to amy's extras only the shared file's new blob (and the
    # root tree, which amy stored itself, is in its pack): 40 bytes of header + 16
    pack, extras = seen["amy2"]
    assert len(extras) - len(seen["amy1"][1]) == 40 + len("a file both get\n")
    assert seen["round2"][1] == 40 + len("a file both get\n")
    assert adopt_alone("amy", "round2", pack, extras, tmp_path / "adopter3") == {
        **amy_files, "new.txt": "a file both get\n", "amy.txt": "amy's own, v2\n"}
    shared_bytes = sum(len(t) for t in shared.values())
    print(json.dumps({"shared_files": len(shared), "shared_bytes": shared_bytes,
                      "amy_pack_bytes": amy_pack, "amy_extras_bytes": len(seen["amy1"][1]),
                      "abe_extras_bytes": len(seen["abe1"][1]),
                      "round1_bytes": seen["round1"][0], "round1_extra_bytes": seen["round1"][1],
                      "round2_bytes": seen["round2"][0],
                      "round2_extra_bytes": seen["round2"][1]}))


def test_the_extras_are_bounded_per_round_and_a_rewind_names_its_tree(
        state_dir: StateDir, tmp_path: Path) -> None:
    """No cluster: a tree larger than one round's budget goes up over several
    rounds, closed only once all of it is up; the newest tree of a stream is its
    last `workspace_tree` or `rewind` (a rewind to before any tree: its `from_tree`),
    read from the WAL incrementally."""
    from actors.trees.store import ObjectStore
    from supervisor.fleet.bundle import NewestTrees, missing

    workspace = tmp_path / "ws"
    fill(workspace, {f"f{i}.txt": f"{i}".ljust(1000, "y") for i in range(10)})
    root = capturer_for(state_dir, "zed", workspace).capture().digest
    store = ObjectStore(packs_dir(state_dir.root))
    present: set[str] = set()
    closed: set[str] = set()
    rounds = []
    while True:
        found = missing(store.get, root, present, closed, budget=3500)
        rounds.append((len(found.objects), found.complete))
        assert sum(len(b) for _, b in found.objects) <= 3500
        present.update(name for name, _ in found.objects)
        closed.update(found.closed)
        if found.complete:
            break
        assert not found.closed
    assert len(rounds) >= 3 and all(n > 0 for n, _ in rounds)  # ~10 KB in 3.5 KB rounds
    assert sum(n for n, _ in rounds) == 11 and root in closed  # the root tree, 10 files
    assert missing(store.get, root, present, closed).objects == []

    writer = FakeWriter()
    other = "b" * 64
    writer.append("agent/zed", "workspace_tree", {"turn": 0, "tree": root}, key="t0")
    dump_wal(state_dir, writer)
    newest = NewestTrees(state_dir.wal_dir)
    assert newest.read() == {"zed": root}
    writer.append("agent/zed", "rewind", {"to_seq": 0, "from_seq": 1, "tree": None,
                                          "from_tree": other}, key="r1")
    writer.append("agent/amy", "workspace_tree", {"turn": 0, "tree": "not a digest"}, key="t1")
    dump_wal(state_dir, writer)
    offset = newest.offset
    assert newest.read() == {"zed": other} and newest.offset > offset
