"""The fold from an agent's events to its state is pure and deterministic, and
a generation (the state at some seq, through its JSON form) plus the events
after it gives exactly the full replay, for any event sequence (hypothesis)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.agent.backends import NO_PROC, ScriptedModel
from actors.kernel.fold import RECENT_RESULT_CHARS, _clip, fold
from actors.kernel.settings import Task
from actors.kernel.state import AgentState

cids = st.sampled_from(["1.0", "1.1", "2.0", "3.0", "4.0"])
requests = st.sampled_from(["req-1.0", "req-2.0", "req-3.0"])
ops = st.sampled_from(["write_file", "edit_file", "read_file", "ask", None])
small = st.integers(0, 500)

payloads: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "session_start": st.fixed_dictionaries({"segment": st.integers(1, 3)}),
    "turn": st.fixed_dictionaries({
        "turn": st.integers(1, 6),
        "actions": st.lists(st.fixed_dictionaries({"op": ops}), max_size=2),
        "usage": st.fixed_dictionaries({"tokens_in": small, "tokens_out": small,
                                        "cost_units": st.floats(0, 1)}),
    }),
    "tool_call": st.fixed_dictionaries({"call_id": cids, "index": st.integers(0, 1),
                                        "op": ops}),
    "schema_reject": st.fixed_dictionaries({"call_id": cids, "errors": st.just(["x"])}),
    "permission": st.fixed_dictionaries({"call_id": cids, "decision": st.sampled_from(
        ["allow", "ask", "deny"]), "rule": st.just("default"), "request": requests}),
    "approval_requested": st.fixed_dictionaries({
        "request": requests, "call_id": cids, "op": st.sampled_from(["write_file", "ask"]),
        "pattern": st.sampled_from(["a.md", "*"]),
        "kind": st.sampled_from(["permission", "clarification"])}),
    "approval_answer": st.fixed_dictionaries({
        "request": requests, "decision": st.sampled_from(["approve", "deny"]),
        "always": st.booleans()}),
    "tool_start": st.fixed_dictionaries({"call_id": cids, "effect": st.none()}),
    "tool_result": st.fixed_dictionaries({"call_id": cids, "status": st.sampled_from(
        ["ok", "error"]), "result": st.fixed_dictionaries({"n": small})}),
    "todos": st.fixed_dictionaries({"items": st.lists(st.fixed_dictionaries(
        {"text": st.text(max_size=5), "done": st.booleans()}), max_size=3)}),
    "turn_aborted": st.fixed_dictionaries({"turn": st.integers(0, 6), "calls": st.lists(
        st.fixed_dictionaries({"call_id": cids, "effect_applied": st.sampled_from(
            [True, False, None])}), max_size=2)}),
    "session_exit": st.fixed_dictionaries({"reason": st.sampled_from(
        ["finished", "budget", "max_turns"])}),
    "budget_resumed": st.fixed_dictionaries({"tokens": small}),
    "operator_answer": st.fixed_dictionaries({"request": requests, "sha256": st.just("s"),
                                              "chars": small, "file": st.just("f")}),
    "operator_correction": st.fixed_dictionaries({
        "correction": st.sampled_from(["k1", "k2"]), "sha256": st.just("s"), "chars": small,
        "file": st.just("f")}),
    "clarification_consumed": st.fixed_dictionaries({"request": requests,
                                                     "turn": st.integers(1, 6)}),
    "correction_consumed": st.fixed_dictionaries({
        "correction": st.sampled_from(["k1", "k2"]), "turn": st.integers(1, 6)}),
    "compaction_recorded": st.fixed_dictionaries({
        "compaction": st.sampled_from(["m1", "m2", "m3"]), "items": st.integers(-2, 5),
        "through_turn": st.integers(0, 6), "sha256": st.just("s"), "chars": small,
        "summary_tokens": small}),
    "compaction_boundary": st.fixed_dictionaries({
        "compaction": st.sampled_from(["m1", "m2", "m3"])}),
    "compaction_abandoned": st.fixed_dictionaries({
        "compaction": st.sampled_from(["m1", "m2", "m3"])}),
    "unknown_event": st.just({}),
    "session_started": st.fixed_dictionaries({"session": st.sampled_from(
        ["01M8P3CHSKDGX7TXF1G4A3MHT5", "01M8P3CHSKDGX7TXF1G4A3MHT6", "not-an-id"]),
        "number": st.integers(1, 3)}),
}

event = st.sampled_from(sorted(payloads)).flatmap(
    lambda name: payloads[name].map(lambda p: (name, p)))
streams = st.lists(event, max_size=80).map(
    lambda evs: [(seq, name, p) for seq, (name, p) in enumerate(evs, start=1)])


@settings(max_examples=150, deadline=None)
@given(streams)
def test_fold_is_deterministic_and_pure(events: list[tuple[int, str, Any]]) -> None:
    start = AgentState()
    before = start.model_dump()
    first = fold(start, events)
    assert fold(AgentState(), events) == first
    assert start.model_dump() == before
    assert first.last_seq == (events[-1][0] if events else 0)


@settings(max_examples=150, deadline=None)
@given(streams, st.data())
def test_generation_plus_tail_equals_full_replay(events: list[tuple[int, str, Any]],
                                                 data: st.DataObject) -> None:
    split = data.draw(st.integers(0, len(events)))
    full = fold(AgentState(), events)
    generation = fold(AgentState(), events[:split])
    on_disk = AgentState.model_validate(json.loads(json.dumps(generation.model_dump(
        mode="json"))))
    assert fold(on_disk, events[split:]) == full
    overlap = max(0, split - 3)  # a tail read from before the generation is harmless
    assert fold(on_disk, events[overlap:]) == full


def test_scripted_placeholders_name_the_newest_proc_ids_of_the_recent_context() -> None:
    task = Task(setup=[{"op": "terminal_input", "proc_id": "{last_terminal}", "text": "x"}],
                steps=[{"op": "bash_poll", "proc_id": "{last_command}", "note": "pass {i}"}],
                repeat=2)
    model = ScriptedModel(task)
    state = AgentState()
    assert model.next_reply(state).actions[0]["proc_id"] == NO_PROC["{last_terminal}"]
    state.recent = [
        {"result": {"proc_id": "t-1111111111111111"}},
        {"result": {"proc_id": "p-2222222222222222"}},
        {"result": {"proc_id": "t-3333333333333333"}},
        {"status": "aborted", "result": {"effect_applied": None}},
    ]
    assert model.next_reply(state).actions[0]["proc_id"] == "t-3333333333333333"
    state.cursor = 2
    [action] = model.next_reply(state).actions
    assert action == {"op": "bash_poll", "proc_id": "p-2222222222222222", "note": "pass 1"}


@settings(max_examples=100, deadline=None)
@given(streams, streams)
def test_the_fold_of_a_stream_is_the_fold_of_its_newest_session(
        older: list[tuple[int, str, Any]], newer: list[tuple[int, str, Any]]) -> None:
    """Whatever came before, `session_started` starts the state afresh."""
    sid = "01M8P3CHSKDGX7TXF1G4A3MHT9"
    shift = len(older) + 1
    start = [(shift, "session_started", {"session": sid, "number": 2})]
    tail = [(seq + shift, name, p) for seq, name, p in newer]
    alone = fold(AgentState(), [(1, "session_started", {"session": sid, "number": 2}),
                                *[(seq + 1, name, p) for seq, name, p in newer]])
    after = fold(AgentState(), [*older, *start, *tail])
    assert after.session == sid or any(name == "session_started" for _, name, _ in newer)
    if not any(name == "session_started" for _, name, _ in newer):
        assert after.model_dump(exclude={"last_seq", "session_seq"}) == alone.model_dump(
            exclude={"last_seq", "session_seq"})


def _clip_by_json(value: Any) -> Any:
    """What `_clip` was before its orjson bound: json's length decides."""
    encoded = json.dumps(value, ensure_ascii=False)
    return value if len(encoded) <= RECENT_RESULT_CHARS else encoded[:RECENT_RESULT_CHARS]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=20), inner,
                                                                max_size=8),
    max_leaves=120)


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_a_clipped_result_is_what_json_s_length_makes_it(value: Any) -> None:
    """The fast bound (orjson's bytes, tripled) keeps a result whole only where
    json's text is within the limit; near it and past it, json decides."""
    assert repr(_clip(value)) == repr(_clip_by_json(value))


def test_a_result_at_the_bound_is_clipped_as_json_clips_it() -> None:
    for size in range(640, 700, 3):  # 3 x orjson's bytes crosses the limit here
        for value in ({"k": "x" * size}, {"k": ["é"] * (size // 6)}, [1e-07] * (size // 6),
                      {"a": [None, True, {"b": "ü" * (size // 2)}]}, "y" * (size * 3)):
            assert repr(_clip(value)) == repr(_clip_by_json(value))


def test_a_usage_charge_never_gives_budget_back_and_a_malformed_one_is_ignored() -> None:
    """`schedule_usage` / `subagent_usage` charge the budget: a negative,
    non-numeric, boolean or non-finite figure charges nothing and never stops
    the fold; a valid one is counted."""
    bad: list[Any] = [-500, "700", None, True, float("nan"), float("inf"), [1]]
    events = [(i + 1, kind, {"tokens": value, "cost_units": value})
              for i, value in enumerate(bad) for kind in ("schedule_usage", "subagent_usage")]
    state = fold(AgentState(), events)
    assert (state.budget.tokens_used, state.budget.cost_used) == (0, 0.0)
    state = fold(state, [(100, "schedule_usage", {"tokens": 200, "cost_units": 0.5}),
                         (101, "subagent_usage", {"tokens": 50})])
    assert (state.budget.tokens_used, state.budget.cost_used) == (250, 0.5)
