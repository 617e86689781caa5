"""A purged session in the fleet's object store (docs/fleet.md, "Purged
sessions"): the generation uploader never uploads a generation in a purged
range and deletes the ones it had uploaded on its next round; the host's
purge ranges go up as `<host>/purges` (no text), and an adopter skips the
records and generations they cover. Through the `supervisor` CLI: after a
purge and the `supervisor gc` that follows, no object this host uploaded
holds the purged session's text. On the real 3-node cluster."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from actors.kernel import generations
from actors.kernel.settings import AgentSpec, write_spec
from actors.kernel.state import AgentState
from actors.sessions import index
from actors.sessions.purged import Purged
from broker.statedir import StateDir
from supervisor.fleet import adopt, purges
from supervisor.fleet.adopt import OBJECTS, Uploader, _names
from supervisor.fleet.generations import download, parse_gen
from tests.acceptance.conftest import corral_home
from tests.acceptance.test_sessions_data import purge, run_to_end, small_generations, task
from tests.fleetkit import Cluster, forget_hosts

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
    real = purges.purged_of

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

    def make(seq: int) -> None:
        state = AgentState(last_seq=seq)
        generations.write(agent_dir, "a1", state, key=f"k{seq}")

    async def stored(js: Any) -> list[int]:
        bucket = await js.object_store(OBJECTS)
        return sorted(s for n in await _names(bucket)
                      if (s := parse_gen(n, host, "a1")) is not None)

    async def settled(js: Any, want: list[int]) -> list[int]:
        # a clustered object store's listing may trail a delete for a moment
        deadline = asyncio.get_running_loop().time() + 10
        while (got := await stored(js)) != want and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        return got

    async def go() -> dict[str, Any]:
        nc: Any = await nats.connect(fleet_cluster.urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            seen: dict[str, Any] = {}
            uploader = Uploader(host, state_dir, 3)
            for seq in (10, 20, 30):
                make(seq)
            await uploader.sync(js)
            seen["before"] = await settled(js, [10, 20, 30])
            bucket = await js.object_store(OBJECTS)
            seen["no_purges"] = purges.purges_object(host) in await _names(bucket)
            # a purge journaled (its generation file not yet staged away): the
            # next round deletes it from the store and names the range
            _journal(state_dir, SESSION, "agent/a1", 15, 25, step="journaled")
            await uploader.sync(js)
            seen["after"] = await settled(js, [10, 30])
            gens = uploader.generations
            seen["deleted"] = gens.deleted_purged if gens else -1
            names = await _names(bucket)
            seen["ranges"] = await purges.read_dead(bucket, names, host)
            # newer generations go up; the purged one, still on disk, never
            make(40)
            await uploader.sync(js)
            seen["newer"] = await settled(js, [10, 30, 40])
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
            # the pass after the purge seals the WAL segment that holds its
            # records; once the runtime appends again, the next compacts them
            # out and the collection after it replaces the pack
            corral.run("gc")
            run_to_end(corral, "pr", task(corral, "third", "third-session"))
            corral.run("gc")
            asyncio.run(_sync(urls, uploader))
            after_gc = asyncio.run(_holding(urls, host, MARKER.encode()))
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
    # after the collection and the agent's next session, no object holds it,
    # and no message of the bucket's stream (deleted objects' chunks are purged)
    assert after_gc == []
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
