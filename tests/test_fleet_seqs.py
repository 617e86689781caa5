"""The import of an adopted agent's records renumbers the seqs they name
(supervisor/fleet/renumber.py): a stream with rewinds (nested, with turns between
them and generation facts), imported under another host's seqs, folds to the
state the dead host's fold gives with every seq mapped; and a reference
outside the imported range is refused before anything is appended."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kernel.fold import fold
from actors.kernel.state import AgentState
from actors.trees import branch
from actors.trees.capture import Capturer
from actors.trees.statcache import StatCache
from actors.trees.store import ObjectStore
from supervisor.fleet import adopt, generations, renumber

SESSION = "01JA0000000000000000000000"


def stream(actions: list[tuple[str, int]], gaps: list[int]) -> list[dict[str, Any]]:
    """The dead host's records of agent/a1 as the agent and `supervisor rewind`
    write them: turns (each a `turn` and a `workspace_tree` record, keys under
    the branch tag), generation facts, rewinds to an earlier turn boundary of the
    active branch. Seqs with gaps (other streams in between)."""
    records: list[dict[str, Any]] = []
    seq = 0

    def add(event: str, payload: dict[str, Any], key: str, origin: str = "a1") -> None:
        nonlocal seq
        seq += 1 + gaps[len(records) % len(gaps)]
        records.append({"seq": seq, "stream": "agent/a1", "event": event, "payload": payload,
                        "key": key, "origin": origin})

    add("session_started", {"session": SESSION, "number": 1}, f"{SESSION}.start")
    for action, arg in actions:
        events = [(r["seq"], r["event"], r["payload"]) for r in records]
        state = fold(AgentState(), branch.active(events))
        tag = state.branch
        if action == "turn":
            turn = state.turn + 1
            add("turn", {"turn": turn}, f"{tag}{SESSION}.t{turn}:turn")
            add("workspace_tree", {"turn": turn, "tree": f"{turn:064x}"},
                f"{tag}{SESSION}.t{turn}:tree")
        elif action == "saved":
            add("generation_saved", {"seq": seq, "sha256": "0" * 64}, f"g{seq}:saved")
        elif action == "rewind" and state.turn > 0:
            to_turn = arg % state.turn
            cut = branch.turn_point(branch.session_events(events), to_turn)
            if cut is None or cut == branch.active(events)[-1][0]:
                continue
            head = branch.active(events)[-1][0]
            add("rewind", {"to_seq": cut, "to_turn": to_turn, "from_seq": head,
                           "tree": branch.tree_at(events, cut), "from_tree": None,
                           "grants": []}, f"rewind:a1:{head}", origin="operator")
    return records


def imported(records: list[dict[str, Any]], base: int, gap: int, chunk: int = 64
             ) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The records as the adopter's writer stores them: each append gets
    consecutive seqs from where its WAL is (other appends between them)."""
    out: list[dict[str, Any]] = []
    next_seq = base

    def append(origin: str, items: list[renumber.Item]) -> int:
        nonlocal next_seq
        first = next_seq
        for event, body, key, _ in items:
            out.append({"seq": next_seq, "event": event, "payload": json.loads(body),
                        "key": key, "origin": origin})
            next_seq += 1
        next_seq += gap
        return first

    seqs = renumber.import_records(records, "a1", chunk, append)
    return out, {r["seq"]: new for r, new in zip(records, seqs, strict=True)}


def folded(records: list[dict[str, Any]]) -> AgentState:
    return fold(AgentState(), branch.active([(r["seq"], r["event"], r["payload"])
                                             for r in records]))


def mapped(state: AgentState, seqs: dict[int, int]) -> AgentState:
    """The test's own renumbering of a state's seq-valued fields."""
    out = state.model_copy(deep=True)
    out.last_seq = seqs[state.last_seq]
    out.session_seq = seqs[state.session_seq]
    if state.branch:
        out.branch = f"r{seqs[int(state.branch[1:-1])]}:"
    if state.last_rewind is not None:
        out.last_rewind = {**state.last_rewind, **{
            k: seqs[state.last_rewind[k]] for k in ("seq", "to_seq", "from_seq")}}
    return out


ACTIONS = st.lists(st.tuples(st.sampled_from(["turn", "turn", "saved", "rewind"]),
                             st.integers(0, 50)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ACTIONS, st.lists(st.integers(0, 5), min_size=1, max_size=5),
       st.integers(1, 10_000), st.integers(0, 7), st.integers(1, 5))
def test_an_imported_stream_folds_to_the_dead_hosts_state_renumbered(
        actions: list[tuple[str, int]], gaps: list[int], base: int, gap: int,
        chunk: int) -> None:
    records = stream(actions, gaps)
    new, seqs = imported(records, base, gap, chunk)
    assert [r["seq"] for r in new] == sorted(seqs.values())
    assert folded(new) == mapped(folded(records), seqs)
    # the keys under a branch tag name the tag of the new rewind
    rewinds = {seqs[r["seq"]] for r in records if r["event"] == "rewind"}
    for record in new:
        if tag := re.match(r"^r(\d+):", record["key"]):
            assert int(tag[1]) in rewinds, record
        if record["event"] == "generation_saved":
            assert record["key"] == f"g{record['payload']['seq']}:saved"
            assert record["payload"]["seq"] in seqs.values()
    # a retry (the writer answering the same seqs for the same keys) writes the same
    again, _ = imported(records, base, gap, chunk)
    assert again == new


def test_without_the_rewrite_the_import_folds_another_state() -> None:
    """What the import did before: the dead host's seqs read as the adopter's."""
    records = stream([("turn", 0), ("turn", 0), ("turn", 0), ("rewind", 1), ("turn", 0),
                      ("rewind", 0), ("turn", 0)], [3])
    assert sum(r["event"] == "rewind" for r in records) == 2
    new, seqs = imported(records, 500, 2)
    as_before = [{**r, "payload": old["payload"]} for r, old in zip(new, records, strict=True)]
    assert folded(new) == mapped(folded(records), seqs)
    assert folded(new).turn == 1 and folded(new).tree == f"{1:064x}"
    wrong = folded(as_before)  # the rewinds cut at unrelated seqs: the session is gone
    assert wrong != folded(new) and wrong.session is None


def test_a_generation_of_a_rewound_stream_is_renumbered() -> None:
    records = stream([("turn", 0), ("turn", 0), ("rewind", 1), ("turn", 0)], [1])
    state = folded(records)
    new, seqs = imported(records, 77, 3)
    rewinds = {r["seq"] for r in records if r["event"] == "rewind"}
    assert generations.renumbered(state, seqs, rewinds) == folded(new)


def bad(records: list[dict[str, Any]], index: int, **payload: Any) -> list[dict[str, Any]]:
    out = [dict(r) for r in records]
    out[index] = {**out[index], "payload": {**out[index]["payload"], **payload}}
    return out


def test_a_seq_outside_the_imported_range_is_refused_before_any_append() -> None:
    records = stream([("turn", 0), ("turn", 0), ("rewind", 0), ("turn", 0), ("saved", 0)], [2])
    at = next(i for i, r in enumerate(records) if r["event"] == "rewind")
    saved = next(i for i, r in enumerate(records) if r["event"] == "generation_saved")
    last = records[-1]["seq"]
    hostile = [
        bad(records, at, to_seq=records[at]["seq"] + 1),  # later than the rewind
        bad(records, at, to_seq=last + 100),  # past the cut
        bad(records, at, to_seq=records[0]["seq"] - 1),  # before the imported range
        bad(records, at, to_seq=records[1]["seq"] + 1) if records[2]["seq"] !=
        records[1]["seq"] + 1 else bad(records, at, to_seq=0),  # a gap: another stream's
        bad(records, at, from_seq="9"),  # not a seq
        bad(records, at, to_seq=True),
        bad(records, saved, seq=last + 1),
        [*records[:2], records[0], *records[2:]],  # out of order
    ]
    appended: list[Any] = []

    def append(origin: str, items: list[renumber.Item]) -> int:
        appended.append(items)
        return 1

    for records_ in hostile:
        with pytest.raises(renumber.SeqReferenceError):
            renumber.import_records(records_, "a1", 64, append)
    assert appended == []


def test_a_tag_naming_no_adopted_rewind_is_left_as_it_is() -> None:
    """A branch tag inherited from a fork's parent (another stream's seq), or one
    naming a record that is no rewind, is a label: not rewritten."""
    records = stream([("turn", 0), ("turn", 0)], [4])
    records[-1] = {**records[-1], "key": f"r{records[1]['seq']}:x"}
    records.append({**records[-1], "seq": records[-1]["seq"] + 1, "key": "r999999:y"})
    new, _ = imported(records, 10, 1)
    assert [r["key"] for r in new[-2:]] == [f"r{records[1]['seq']}:x", "r999999:y"]


def test_the_cut_is_at_a_rewind_whose_workspace_the_adopter_holds(tmp_path: Path) -> None:
    """A rewind is a turn boundary: the cut is the newest tree record or rewind
    whose workspace's objects are in the store (its `tree`; for a rewind to
    before any tree, which restores nothing, the `from_tree` it captured)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    store = ObjectStore(tmp_path / "packs")
    cap = Capturer(ws, store, StatCache.load(None))
    (ws / "a.txt").write_bytes(b"1")
    one = cap.capture().digest
    (ws / "a.txt").write_bytes(b"12")
    two = cap.capture().digest

    def rec(seq: int, event: str, payload: dict[str, Any]) -> dict[str, Any]:
        return {"seq": seq, "stream": "agent/a1", "event": event, "payload": payload,
                "key": f"k{seq}", "origin": "a1"}

    records = [rec(1, "session_started", {"session": SESSION}),
               rec(2, "workspace_tree", {"turn": 1, "tree": one}),
               rec(3, "workspace_tree", {"turn": 2, "tree": two}),
               rec(4, "rewind", {"to_seq": 2, "from_seq": 3, "tree": one, "from_tree": two})]
    chosen = adopt.cut(records, "a1", store)
    assert (chosen.tree, len(chosen.records), chosen.dropped) == (one, 4, 0)
    to_nothing = [*records[:3], rec(4, "rewind", {"to_seq": 1, "from_seq": 3, "tree": None,
                                                  "from_tree": two})]
    assert adopt.cut(to_nothing, "a1", store).tree == two
    absent = [*records[:3], rec(4, "rewind", {"to_seq": 2, "from_seq": 3, "tree": "0" * 64,
                                              "from_tree": two})]
    chosen = adopt.cut(absent, "a1", store)  # its tree not held: an older cut
    assert (chosen.tree, len(chosen.records), chosen.dropped) == (two, 3, 1)
