"""A purged session in the fleet's object store (docs/fleet.md, "Purged
sessions"): the generation uploader never uploads a generation in a purged
range and deletes the ones it had uploaded on its next round; the host's
purge ranges go up as `<host>/purges` (no text), and an adopter skips the
records and generations they cover. Through the `supervisor` CLI: after a
purge and the `supervisor gc` that follows, no object this host uploaded
holds the purged session's text, and a host that adopts the agent of a dead
host that purged a session holds none of it either (its replicated stream
still does: the documented limit). On the real 3-node cluster."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.kernel import generations
from actors.kernel.settings import AgentSpec, write_spec
from actors.kernel.state import AgentState
from actors.sessions import index
from actors.sessions.purged import Purged, purged_of
from actors.trees.store import packs_dir
from actors.writer.wal import list_segments
from broker.statedir import StateDir
from supervisor.fleet import adopt, purges
from supervisor.fleet.adopt import (
    OBJECTS,
    Uploader,
    _names,
    parse_chunk,
    uploaded_pack_size,
)
from supervisor.fleet.generations import download, parse_gen
from tests.acceptance.conftest import corral_home
from tests.acceptance.test_sessions_data import purge, run_to_end, small_generations, task
from tests.agentkit import write_task
from tests.fleetkit import (
    Cluster,
    forget_hosts,
    operator_key_and_hosts,
    read_stream,
    stored_generations,
)
from tests.processes import ProcessTracker, wait_for
from tests.test_fleet_hosts import cli, fleet_view, host_config, other_state_dir

__all__ = ["other_state_dir"]  # the fixture, used by name

pytestmark = [pytest.mark.fleet]

SESSION = "01M8P3CHSKDGX7TXF1G4A3MHT5"
MARKER = "fleet-purge-marker-5d1e0b"


def _journal(state_dir: StateDir, session_id: str, stream: str, first: int, last: int, *,
             step: str = "done") -> None:
    """A purge_journal row, as `supervisor sessions purge` writes it
    (actors/sessions/purge.py)."""
    conn = index.connect(state_dir.root)
    try:
        with index.transaction(conn):
            conn.execute("INSERT INTO purge_journal VALUES(?,?,?,?,?,?,NULL)",
                         (session_id, stream, first, last, step, time.time()))
    finally:
        conn.close()


def test_the_purges_object_round_trips_and_a_malformed_one_is_refused() -> None:
    ranges = {"agent/a1": [Purged(SESSION, 5, 9), Purged("S2", 20, 30)],
              "agent/b": [Purged("S3", 1, 2)]}
    data = purges.encode(ranges)
    assert purges.decode(data) == ranges
    assert b"text" not in data and set(purges.decode(data)) == {"agent/a1", "agent/b"}
    for bad in (b"not json", b"[]", b'{"purges": {}}', b'{"purges": [1]}',
                b'{"purges": [{"stream": "agent/a", "first_seq": "1", "last_seq": 2,'
                b' "session_id": "s"}]}',
                b'{"purges": [{"stream": "agent/a", "first_seq": true, "last_seq": 2,'
                b' "session_id": "s"}]}'):
        with pytest.raises(purges.PurgesFormatError):
            purges.decode(bad)
    with pytest.raises(purges.PurgesFormatError):
        purges.decode(b" " * (purges.MAX_BYTES + 1))


def test_an_adopter_skips_the_purged_records_and_its_cut_falls_before_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    records = [{"seq": s, "stream": st, "event": e, "payload": p}
               for s, st, e, p in [
                   (3, "agent/a1", "session_started", {"session": "A"}),
                   (4, "agent/a1", "workspace_tree", {"tree": "1" * 64}),
                   (6, "agent/a1", "session_started", {"session": SESSION}),
                   (7, "agent/a2", "turn", {}),  # another stream in the range: kept
                   (8, "agent/a1", "workspace_tree", {"tree": "2" * 64}),
                   (9, "agent/a1", "turn", {}),
               ]]
    ranges = {"agent/a1": [Purged(SESSION, 6, 9)]}
    kept = purges.visible_records(records, ranges)
    assert [(r["seq"], r["stream"]) for r in kept] == [(3, "agent/a1"), (4, "agent/a1"),
                                                       (7, "agent/a2")]

    # every tree held: the cut is the newest tree the purge left
    monkeypatch.setattr(adopt, "tree_present", lambda _store, _digest: True)
    chosen = adopt.cut(kept, "a1", None)  # type: ignore[arg-type]
    assert chosen.tree == "1" * 64 and [r["seq"] for r in chosen.records] == [3, 4]
    gens = [(4, b"a"), (8, b"b")]
    assert purges.unpurged_generations(gens, ranges, "h", "a1") == [(4, b"a")]
    assert purges.unpurged_generations(gens, ranges, "h", "a2") == gens


def test_the_purge_ranges_are_read_again_only_when_the_index_changed(
        state_dir: StateDir, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = purged_of

    def counting(root: Path, stream: str) -> list[Purged]:
        calls.append(stream)
        return real(root, stream)

    monkeypatch.setattr(purges, "purged_of", counting)
    watch = purges.PurgeWatch(state_dir)
    assert watch.read(["a1"]) == {}  # no index yet
    _journal(state_dir, SESSION, "agent/a1", 10, 20, step="journaled")  # hidden from here on
    calls.clear()
    assert watch.read(["a1", "a2"]) == {"agent/a1": [Purged(SESSION, 10, 20)]}
    assert sorted(calls) == ["agent/a1", "agent/a2"]
    calls.clear()
    assert watch.read(["a1", "a2"]) == {"agent/a1": [Purged(SESSION, 10, 20)]}
    assert watch.read(["a2"]) == {"agent/a1": [Purged(SESSION, 10, 20)]}
    assert calls == []  # nothing changed: nothing read
    assert watch.read(["a1", "a3"])["agent/a1"] == [Purged(SESSION, 10, 20)]
    assert calls == ["agent/a3"]  # only the stream not read yet
    _journal(state_dir, "S2", "agent/a2", 30, 40)
    calls.clear()
    assert watch.read(["a1", "a2"]) == {"agent/a1": [Purged(SESSION, 10, 20)],
                                        "agent/a2": [Purged("S2", 30, 40)]}
    assert sorted(calls) == ["agent/a1", "agent/a2"]


@pytest.mark.timeout(120)
def test_purged_generations_leave_the_object_store_and_never_go_up(
        fleet_cluster: Cluster, state_dir: StateDir, tmp_path: Path) -> None:
    import nats

    fleet_cluster.wait_ready()
    host = f"hp{uuid.uuid4().hex[:6]}"
    work = tmp_path / "task.yaml"
    work.write_text("steps: []\n")
    write_spec(state_dir, "a1", AgentSpec(task=str(work)))
    agent_dir = state_dir.agent_dir("a1")
    pack = packs_dir(state_dir.root) / "a1.pack"
    pack.parent.mkdir(parents=True, exist_ok=True)
    pack.write_bytes(b"p" * 1000)

    def make(seq: int) -> None:
        state = AgentState(last_seq=seq)
        generations.write(agent_dir, "a1", state, key=f"k{seq}")

    async def stored(js: Any) -> list[int]:
        bucket = await js.object_store(OBJECTS)
        return sorted(s for n in await _names(bucket)
                      if (s := parse_gen(n, host, "a1")) is not None)

    async def chunks(js: Any) -> list[tuple[str, int]]:
        """The pack's chunks, once the listing shows one generation (it may
        trail a delete for a moment), or at the deadline."""
        bucket = await js.object_store(OBJECTS)
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            got = sorted(c for n in await _names(bucket) if (c := parse_chunk(n, host, "a1")))
            if len(got) == 1 or asyncio.get_running_loop().time() > deadline:
                return got
            await asyncio.sleep(0.1)

    async def go() -> dict[str, Any]:
        nc: Any = await nats.connect(fleet_cluster.urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            seen: dict[str, Any] = {}
            uploader = Uploader(host, state_dir, 3)
            for seq in (10, 20, 30):
                make(seq)
            await uploader.sync(js)
            seen["before"] = await stored_generations(js, host, "a1", [10, 20, 30])
            bucket = await js.object_store(OBJECTS)
            seen["no_purges"] = purges.purges_object(host) in await _names(bucket)
            seen["chunks"] = await chunks(js)
            # a purge journaled (its generation file not yet staged away): the
            # next round deletes it from the store and names the range
            _journal(state_dir, SESSION, "agent/a1", 15, 25, step="journaled")
            await uploader.sync(js)
            seen["after"] = await stored_generations(js, host, "a1", [10, 30])
            seen["chunks_after"] = await chunks(js)
            gens = uploader.generations
            seen["deleted"] = gens.deleted_purged if gens else -1
            names = await _names(bucket)
            seen["ranges"] = await purges.read_dead(bucket, names, host)
            # newer generations go up; the purged one, still on disk, never
            make(40)
            await uploader.sync(js)
            seen["newer"] = await stored_generations(js, host, "a1", [10, 30, 40])
            restarted = Uploader(host, state_dir, 3)  # a restarted host: the same
            await restarted.sync(js)
            seen["restarted"] = (await stored(js), restarted.generations.uploads
                                 if restarted.generations else -1)
            seen["download"] = [s for s, _ in await download(
                bucket, await _names(bucket), host, "a1")]
            return seen
        finally:
            await nc.close()

    try:
        seen = asyncio.run(go())
    finally:
        forget_hosts(fleet_cluster.urls, [host])
    assert seen["before"] == [10, 20, 30]
    assert seen["no_purges"] is False  # a host without purges uploads no purges object
    assert seen["after"] == [10, 30]
    # the purge started a new pack generation (no extras chunk of the older one left)
    [(gen, offset)] = seen["chunks"]
    [(gen2, offset2)] = seen["chunks_after"]
    assert gen2 != gen and offset == offset2 == 0
    assert seen["deleted"] == 1
    assert seen["ranges"] == {"agent/a1": [Purged(SESSION, 15, 25)]}
    assert seen["newer"] == [10, 30, 40]
    assert seen["restarted"] == ([10, 30, 40], 0)
    assert seen["download"] == [40, 30, 10]


async def _holding(urls: list[str], host: str, text: bytes) -> list[str]:
    """The names of `host`'s objects whose bytes hold `text`."""
    import nats

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        bucket = await nc.jetstream(timeout=5).object_store(OBJECTS)
        found = []
        for name in await _names(bucket):
            if name.startswith(f"{host}/") and text in ((await bucket.get(name)).data or b""):
                found.append(name)
        return sorted(found)
    finally:
        await nc.close()


async def _raw_holding(urls: list[str], text: bytes) -> tuple[int, int]:
    """How many messages of the object store's stream (every chunk and
    meta message the bucket still holds, deleted objects' included) hold
    `text`; and how many it holds."""
    import nats
    from nats.js.errors import NotFoundError

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        js = nc.jetstream(timeout=5)
        stream = f"OBJ_{OBJECTS}"
        state = (await js.stream_info(stream)).state
        found = seen = 0
        for seq in range(int(state.first_seq), int(state.last_seq) + 1):
            try:
                msg = await js.get_msg(stream, seq)
            except NotFoundError:
                continue
            seen += 1
            found += text in (msg.data or b"")
        return found, seen
    finally:
        await nc.close()


async def _sync(urls: list[str], uploader: Uploader) -> None:
    import nats

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        await uploader.sync(nc.jetstream(timeout=5))
    finally:
        await nc.close()


@pytest.mark.process
@pytest.mark.timeout(360)
def test_after_a_purge_and_gc_no_uploaded_object_holds_the_session(
        fleet_cluster: Cluster) -> None:
    fleet_cluster.wait_ready()
    host = f"hq{uuid.uuid4().hex[:6]}"
    urls = fleet_cluster.urls
    try:
        with corral_home() as corral:
            corral.up(config=small_generations(corral))
            run_to_end(corral, "pr", task(corral, "first", "first-session"))
            run_to_end(corral, "pr", task(corral, "second", MARKER))
            uploader = Uploader(host, StateDir(corral.state_dir), 3)
            asyncio.run(_sync(urls, uploader))
            before = asyncio.run(_holding(urls, host, MARKER.encode()))
            raw_before = asyncio.run(_raw_holding(urls, MARKER.encode()))
            first, second = (r["session_id"] for r in corral.sessions("pr"))

            purge(corral, second)
            asyncio.run(_sync(urls, uploader))
            after_purge = asyncio.run(_holding(urls, host, MARKER.encode()))
            # the one gc after the purge compacts its records out of the WAL
            # and collects its trees: the pack is replaced
            corral.run("gc")
            asyncio.run(_sync(urls, uploader))
            after_gc = asyncio.run(_holding(urls, host, MARKER.encode()))
            # the agent's next spawn replaces its spec
            run_to_end(corral, "pr", task(corral, "third", "third-session"))
            asyncio.run(_sync(urls, uploader))
            after_spawn = asyncio.run(_holding(urls, host, MARKER.encode()))
            ranges = asyncio.run(_ranges(urls, host))
            raw = asyncio.run(_raw_holding(urls, MARKER.encode()))
            third = asyncio.run(_holding(urls, host, b"third-session"))
    finally:
        forget_hosts(urls, [host])
    # before: the session's text went up in its generations, its pack and its
    # spec (the task text, which the operator's task file holds too)
    assert {n.split("/")[2].split(".")[0] for n in before} == {"gen", "pack", "spec"}, before
    assert raw_before[0] > 0, raw_before
    # the purge: its generations leave the store on the next round; what is
    # left is the agent's until the collection (its pack) or its next spawn (its spec)
    assert {n.split("/")[2].split(".")[0] for n in after_purge} == {"pack", "spec"}, after_purge
    assert after_gc == [f"{host}/pr/spec"], after_gc
    # after the agent's next spawn no object holds it, and no message of the
    # bucket's stream (deleted objects' chunks are purged)
    assert after_spawn == []
    assert raw[0] == 0 and raw[1] > 0, raw
    assert [p.session_id for p in ranges["agent/pr"]] == [second]
    assert ranges["agent/pr"][0].first_seq <= ranges["agent/pr"][0].last_seq
    assert first != second
    assert any("/gen." in n for n in third), "the agent's later work still goes up"


async def _ranges(urls: list[str], host: str) -> purges.Ranges:
    import nats

    nc: Any = await nats.connect(urls, connect_timeout=2)
    try:
        bucket = await nc.jetstream(timeout=5).object_store(OBJECTS)
        return await purges.read_dead(bucket, await _names(bucket), host)
    finally:
        await nc.close()


def _steps(name: str, marker: str) -> list[dict[str, Any]]:
    """Edits whose text holds `marker`; the last takes it out of the workspace
    (the agent's, not the session's)."""
    return [{"op": "write_file", "path": "notes.md", "content": f"{marker} 0\n"},
            *({"op": "edit_file", "path": "notes.md", "old": f"{marker} {i}",
               "new": f"{marker} {i + 1}"} for i in range(4)),
            {"op": "edit_file", "path": "notes.md", "old": f"{marker} 4", "new": f"{name} done"},
            {"op": "finish", "summary": f"{name} done"}]


@pytest.mark.process
@pytest.mark.timeout(360)
def test_an_adopter_takes_nothing_of_a_purged_session(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir, tmp_path: Path) -> None:
    """Host A runs three sessions of one agent and purges the second (then
    collects, as the operator does); host A dies; host B adopts the agent:
    no file of host B holds the purged session's text, while A's replicated
    stream still does (hidden until its retention)."""
    fleet_cluster.wait_ready()
    urls = fleet_cluster.urls
    key, ha, hb = operator_key_and_hosts(state_dir.root)
    try:
        configs = {}
        for directory, host in ((state_dir, ha), (other_state_dir, hb)):
            path = host_config(directory, host, fleet_cluster, key, agents=0)
            config = yaml.safe_load(path.read_text())
            config["agent"] = {"snapshot_every": 4}
            path.write_text(yaml.safe_dump(config))
            configs[host] = path
        up_a = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                                "--config", str(configs[ha])], name="up-a")
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir",
                         str(other_state_dir.root), "--config", str(configs[hb])], name="up-b")

        def both_running() -> bool:
            if not (state_dir.run_dir / "fleet.json").exists():
                return False
            view = fleet_view(processes, state_dir)
            return all(view.get(h) and view[h]["children"] and
                       all(c["state"] == "running" for c in view[h]["children"])
                       for h in (ha, hb))

        wait_for(both_running, 90, "both hosts running", interval_s=0.3)

        def sessions() -> list[dict[str, Any]]:
            done = cli(processes, state_dir, "sessions", "list", "--all", "--agent", "pr",
                       "--json")
            assert done.returncode == 0, done.stderr
            rows: list[dict[str, Any]] = json.loads(done.stdout)
            return rows

        def run(name: str, marker: str, count: int) -> None:
            work = write_task(tmp_path / f"{name}.yaml", _steps(name, marker))
            done = cli(processes, state_dir, "spawn", "pr", "--task", str(work), "--json")
            assert done.returncode == 0, done.stdout + done.stderr
            wait_for(lambda: [r["status"] for r in sessions()] == ["finished"] * count, 90,
                     f"pr's session {name} finished", interval_s=0.5)

        def ok(*args: str) -> None:
            done = cli(processes, state_dir, *args)
            assert done.returncode == 0, done.stdout + done.stderr

        run("first", "first-session", 1)
        run("second", MARKER, 2)
        second = sessions()[1]["session_id"]
        ok("sessions", "archive", second)
        ok("sessions", "purge", second, "--confirm", second)
        ok("gc")  # its records out of the WAL, its trees out of the pack
        run("third", "third-session", 2)  # the agent's spec no longer the purged task's
        local = (packs_dir(state_dir.root) / "pr.pack").stat().st_size
        wait_for(lambda: asyncio.run(_ranges(urls, ha)).get("agent/pr")
                 and uploaded_pack_size(urls, ha, "pr") == local
                 and not asyncio.run(_holding(urls, ha, MARKER.encode())), 30,
                 "host A's purge ranges and collected pack uploaded", interval_s=0.3)

        up_a.send_signal(signal.SIGKILL)  # the whole host goes (its children with it)
        up_a.wait(10)
        log_b = other_state_dir.root / "logs" / "supervisor.log"

        def adopted() -> list[dict[str, Any]]:
            if not log_b.exists():
                return []
            return [line for raw in log_b.read_bytes().splitlines()
                    if b"fleet_agent_adopted" in raw and (line := json.loads(raw))["agent"] == "pr"]

        [line] = wait_for(adopted, 90, "host B adopted pr", interval_s=0.3)
        held = sorted(str(path.relative_to(other_state_dir.root))
                      for path in other_state_dir.root.rglob("*")
                      if path.is_file() and not path.is_symlink()
                      and MARKER.encode() in path.read_bytes())
        third_held = [path for _first, path in list_segments(other_state_dir.wal_dir)
                      if b"third-session" in path.read_bytes()]
        in_stream = [m for m in read_stream(urls, ha)
                     if any(MARKER.encode() in line for line in m.lines)]
    finally:
        forget_hosts(urls, [ha, hb])
    assert line["records"] > 0, line  # the first and third sessions' records came over
    assert third_held, "the third session's records on host B"
    assert held == [], held
    assert in_stream, "the documented limit: the dead host's stream keeps them, hidden"
