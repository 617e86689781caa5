"""An agent's state generations in the object store (docs/fleet.md,
"Generations"): uploaded incrementally, never twice (not even by a restarted
host), at most KEPT per agent; an adopter takes only one the dead host's
stream vouches for (a `generation_saved` fact with the digest of the very
bytes), at or below the cut, whose record is the stream's; and a generation
renumbered to the adopter's seqs plus the tail folds to exactly what folding
every adopted record on the adopter gives (hypothesis). The process-level
adoption from a generation, and the fallback from a corrupted one, are in
tests/test_fleet_adopt.py."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kernel import generations
from actors.kernel.fold import fold
from actors.kernel.settings import AgentSpec, write_spec
from actors.kernel.state import AgentState
from broker.statedir import StateDir
from supervisor.fleet import generations as fleet_generations
from supervisor.fleet.adopt import OBJECTS, Uploader, _names
from tests.fleetkit import Cluster, forget_hosts, stored_generations
from tests.test_agent_state import event

SESSION = "01M8P3CHSKDGX7TXF1G4A3MHT5"


def _records(events: list[tuple[int, str, Any]], agent: str = "a1") -> list[dict[str, Any]]:
    return [{"seq": seq, "stream": f"agent/{agent}", "event": name, "payload": payload,
             "key": f"k{seq}", "origin": agent} for seq, name, payload in events]


def _generation(tmp: Path, events: list[tuple[int, str, Any]]) -> tuple[bytes, str]:
    """The generation file an agent writes after folding `events` (its bytes, its digest)."""
    state = fold(AgentState(), events)
    digest = generations.write(tmp, "a1", state, key=f"k{state.last_seq}")
    raw = (generations.generations_dir(tmp) / f"gen-{state.last_seq:020d}.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == digest
    return raw, digest


def _saved(seq: int, of: int, digest: str) -> tuple[int, str, Any]:
    return seq, generations.SAVED_EVENT, {"seq": of, "sha256": digest}


BASE: list[tuple[int, str, Any]] = [
    (3, "session_started", {"session": SESSION, "number": 1}),
    (5, "session_start", {"segment": 1}),
    (9, "turn", {"turn": 1, "actions": [{"op": "write_file"}], "usage": {}}),
    (12, "workspace_tree", {"turn": 1, "tree": "t1"}),
]


def test_only_a_vouched_generation_at_or_below_the_cut_is_chosen(tmp_path: Path) -> None:
    raw, digest = _generation(tmp_path, BASE)
    records = _records([*BASE, _saved(14, 12, digest),
                        (20, "turn", {"turn": 2, "actions": [], "usage": {}})])
    gen, refused = fleet_generations.choose([(12, raw)], records, "a1", through_seq=20)
    assert gen is not None and gen.state.last_seq == 12 and refused == []
    # the cut before it: the generation holds records that are not adopted
    assert fleet_generations.choose([(12, raw)], records, "a1", through_seq=9) == (
        None, [(12, "after the cut")])
    # a byte changed (a corrupted or forged object): its digest is not the fact's
    bad = raw.replace(b'"turn":1', b'"turn":7')
    assert bad != raw
    assert fleet_generations.choose([(12, bad)], records, "a1", through_seq=20)[0] is None
    # no fact vouches for it (the agent died between the file and the fact)
    unvouched = [r for r in records if r["event"] != generations.SAVED_EVENT]
    assert fleet_generations.choose([(12, raw)], unvouched, "a1", 20)[1] == [
        (12, "no generation_saved fact with its digest")]
    # the fact is another agent's: it vouches for nothing of a1
    other = [dict(r, stream="agent/a2") if r["event"] == generations.SAVED_EVENT else r
             for r in records]
    assert fleet_generations.choose([(12, raw)], other, "a1", 20)[0] is None
    # named under another seq than its own
    assert fleet_generations.choose([(9, raw)], records, "a1", 20)[0] is None
    # garbage vouched for (a digest of bytes that are no generation)
    junk = b"\xff" * 40
    vouch_junk = [*records, _records([_saved(21, 9, hashlib.sha256(junk).hexdigest())])[0]]
    assert fleet_generations.choose([(9, junk)], vouch_junk, "a1", 20)[1] == [
        (9, "not a generation of that seq")]
    # the stream's record at its seq has another key: another history
    rekeyed = [dict(r, key="other") if r["seq"] == 12 else r for r in records]
    assert fleet_generations.choose([(12, raw)], rekeyed, "a1", 20)[1] == [
        (12, "the stream's record at its seq is another")]
    # a rewind among the adopted records: its branch fields are renumbered, so the
    # generation is used (supervisor/fleet/renumber.py)
    rewound = [*records[:-1], _records([(18, "rewind", {"to_seq": 9})])[0], records[-1]]
    assert fleet_generations.choose([(12, raw)], rewound, "a1", 20)[1] == []
    # the newest usable one wins; newer bad ones are reported
    older, older_digest = _generation(tmp_path, BASE[:3])
    both = [*records, _records([_saved(22, 9, older_digest)])[0]]
    gen, refused = fleet_generations.choose([(9, older), (12, bad)], both, "a1", 20)
    assert gen is not None and gen.state.last_seq == 9
    assert refused == [(12, "no generation_saved fact with its digest")]


@settings(max_examples=50, deadline=None)
@given(st.lists(event, min_size=1, max_size=60), st.data())
def test_a_renumbered_generation_plus_its_tail_is_the_full_fold_on_the_adopter(
        evs: list[tuple[str, Any]], data: st.DataObject) -> None:
    # the dead host's seqs and the adopter's: both increasing, with other streams' gaps
    old_gaps = data.draw(st.lists(st.integers(1, 4), min_size=len(evs), max_size=len(evs)))
    new_gaps = data.draw(st.lists(st.integers(1, 4), min_size=len(evs), max_size=len(evs)))
    old_seqs = [sum(old_gaps[: i + 1]) for i in range(len(evs))]
    new_seqs = [100 + sum(new_gaps[: i + 1]) for i in range(len(evs))]
    cut = data.draw(st.integers(1, len(evs)))
    old = [(s, name, p) for s, (name, p) in zip(old_seqs, evs, strict=True)]
    new = [(s, name, p) for s, (name, p) in zip(new_seqs, evs, strict=True)]
    generation = AgentState.model_validate_json(fold(AgentState(), old[:cut]).model_dump_json())
    mapped = fleet_generations.renumbered(generation, dict(zip(old_seqs, new_seqs, strict=True)))
    assert mapped is not None
    assert fold(mapped, new[cut:]) == fold(AgentState(), new)


def test_generations_go_up_incrementally_once_and_bounded(
        fleet_cluster: Cluster, state_dir: StateDir, tmp_path: Path) -> None:
    import nats

    fleet_cluster.wait_ready()
    host = f"hg{uuid.uuid4().hex[:6]}"
    task = tmp_path / "task.yaml"
    task.write_text("steps: []\n")
    write_spec(state_dir, "a1", AgentSpec(task=str(task)))
    agent_dir = state_dir.agent_dir("a1")
    events: list[tuple[int, str, Any]] = []

    def make(seq: int) -> bytes:
        events.append((seq, "session_start", {"segment": seq}))
        generations.write(agent_dir, "a1", fold(AgentState(), events), key=f"k{seq}")
        return (generations.generations_dir(agent_dir) / f"gen-{seq:020d}.json").read_bytes()

    async def stored(js: Any) -> list[int]:
        bucket = await js.object_store(OBJECTS)
        return sorted(s for n in await _names(bucket)
                      if (s := fleet_generations.parse_gen(n, host, "a1")) is not None)

    async def go() -> dict[str, Any]:
        nc: Any = await nats.connect(fleet_cluster.urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            seen: dict[str, Any] = {}
            uploader = Uploader(host, state_dir, 3)
            await uploader.sync(js)  # no generation yet
            seen["none"] = await stored(js)
            first = make(10)
            await uploader.sync(js)
            seen["one"] = (await stored(js), uploader.generations.uploaded_bytes
                           if uploader.generations else -1, len(first))
            await uploader.sync(js)  # nothing new: nothing uploaded
            seen["again"] = uploader.generations.uploads if uploader.generations else -1
            for seq in (20, 30, 40, 50):  # the agent keeps 3; the store keeps KEPT
                make(seq)
            await uploader.sync(js)
            seen["bounded"] = await stored_generations(js, host, "a1", [30, 40, 50])
            # a restarted host (a new uploader) uploads nothing already there
            restarted = Uploader(host, state_dir, 3)
            await restarted.sync(js)
            seen["restarted"] = restarted.generations.uploads if restarted.generations else -1
            newest = make(60)
            await restarted.sync(js)
            listed = await stored_generations(js, host, "a1", [40, 50, 60])
            seen["after_restart"] = (listed, restarted.generations.uploads
                                     if restarted.generations else -1)
            bucket = await js.object_store(OBJECTS)
            seen["download"] = await fleet_generations.download(
                bucket, await _names(bucket), host, "a1")
            seen["newest"] = newest
            return seen
        finally:
            await nc.close()

    try:
        seen = asyncio.run(go())
    finally:
        forget_hosts(fleet_cluster.urls, [host])
    assert seen["none"] == []
    assert seen["one"] == ([10], seen["one"][2], seen["one"][2])  # its bytes, once
    assert seen["again"] == 1
    assert seen["bounded"] == [30, 40, 50]  # at most KEPT, the newest
    assert seen["restarted"] == 0
    assert seen["after_restart"] == ([40, 50, 60], 1)
    assert [s for s, _ in seen["download"]] == [60, 50, 40]  # newest first
    assert seen["download"][0][1] == seen["newest"]  # byte for byte


def test_what_goes_up_is_new_and_bounded(state_dir: StateDir) -> None:
    assert fleet_generations._new([1, 2, 3], [2]) == [1, 3]
    assert fleet_generations._new([1, 5], [2, 3, 4]) == [5]  # older than every one kept: not
    uploader = fleet_generations.GenerationUploader("h", state_dir)
    gens = generations.generations_dir(state_dir.agent_dir("a1"))
    gens.mkdir(parents=True)
    with (gens / f"gen-{7:020d}.json").open("wb") as f:
        f.truncate(fleet_generations.MAX_BYTES + 1)  # sparse: over the bound, not written
    assert uploader._local("a1") == [7]
    assert uploader._read("a1", 7) is None  # never uploaded
    assert uploader._read("a1", 8) is None  # pruned meanwhile
    assert ("a1", 7) in uploader.too_large
