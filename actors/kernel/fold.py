"""The fold of an agent's stream (`agent/<name>`) into its state
(actors/kernel/state.py): pure, bounded; events at or below `last_seq` are
skipped; `session_started` starts afresh. See docs/agents.md ("State and
generations").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

import orjson

from actors.kernel import branch_events, pipeline_track
from actors.kernel.state import AgentState, Approval, Call, Compaction, Event, PendingInput
from broker import compactjson

SESSION_STARTED = "session_started"
_SESSION_ID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")  # actors/sessions/ids.py
RECENT_MAX = 256  # a backend keeps its own window; compaction keeps this well below
RECENT_RESULT_CHARS = 2000


def fold(state: AgentState, events: Iterable[Event]) -> AgentState:
    """The state after `events` (in seq order); `state` is not modified."""
    out = state.model_copy(deep=True)
    fold_into(out, events)
    return out


def fold_into(state: AgentState, events: Iterable[Event]) -> None:
    """Fold `events` into `state` itself: what `fold` does without the copy, for
    the one owner of a state (the agent loop folds every record it appends; a
    deep copy each time was a fifth of a scripted agent's time)."""
    for seq, event, payload in events:
        if seq <= state.last_seq:
            continue
        if event == SESSION_STARTED:
            _begin_session(state, seq, payload if isinstance(payload, dict) else {})
        elif event in branch_events.EVENTS:
            branch_events.apply(state, seq, event, payload if isinstance(payload, dict) else {})
        else:
            _apply(state, event, payload if isinstance(payload, dict) else {})
        state.last_seq = seq
        state.counts.events += 1


def _begin_session(state: AgentState, seq: int, p: dict[str, Any]) -> None:
    """A new session of the stream: the state starts afresh from this fact (the
    fold of a stream is the fold of its newest session; docs/sessions.md)."""
    session = p.get("session")
    if not isinstance(session, str) or not _SESSION_ID.fullmatch(session):
        return  # not a session id: ignored, as any malformed fact is
    number = p.get("number")
    parent = p.get("parent_agent")
    fresh = AgentState(
        session=session, session_seq=seq,
        session_no=number if type(number) is int and number > 0 else state.session_no + 1,
        parent_agent=parent if isinstance(parent, str) else None)
    for field in AgentState.model_fields:
        setattr(state, field, getattr(fresh, field))


def _remember(state: AgentState, item: dict[str, Any]) -> None:
    state.recent.append(item)
    if len(state.recent) > RECENT_MAX:
        del state.recent[: len(state.recent) - RECENT_MAX]


def _clip(value: Any) -> Any:
    """A result as the context keeps it: whole while its JSON (json's, spaces
    after separators) is at most RECENT_RESULT_CHARS, else that JSON's head.
    Most results are far below: orjson's compact bytes, tripled, bound json's
    characters from above (a separator's space, a float's longer exponent,
    NaN's name: each at most two more per byte orjson writes), so a result
    under that bound is kept without json's encode; any other goes to json."""
    text = repr(value) if not isinstance(value, dict | list | str | int | float | None) else None
    if text is not None:
        return text[:RECENT_RESULT_CHARS]
    try:
        if 3 * len(orjson.dumps(value, option=compactjson.PASSTHROUGH)) <= RECENT_RESULT_CHARS:
            return value
    except (orjson.JSONEncodeError, TypeError):
        pass  # (a key not a str, an integer past 64 bits, a lone surrogate: json says)
    import json  # noqa: PLC0415 - only for large results

    encoded = json.dumps(value, ensure_ascii=False)
    return value if len(encoded) <= RECENT_RESULT_CHARS else encoded[:RECENT_RESULT_CHARS]


def _close_turn_if_settled(state: AgentState) -> None:
    if state.open_turn is None:
        return
    if len(state.calls) == len(state.actions) and all(c.settled for c in state.calls.values()):
        _close_turn(state)


def _close_turn(state: AgentState) -> None:
    for call in state.calls.values():
        state.approvals = {k: a for k, a in state.approvals.items() if a.call_id != call.call_id}
    state.open_turn = None
    state.actions = []
    state.calls = {}


def _action(state: AgentState, call: Call) -> Any:
    return state.actions[call.index] if 0 <= call.index < len(state.actions) else None


def _add_input(state: AgentState, kind: Literal["answer", "correction"], ident: str,
               p: dict[str, Any]) -> None:
    state.inputs.append(PendingInput(kind=kind, ident=ident, sha256=str(p.get("sha256")),
                                     chars=_int(p.get("chars")), file=str(p.get("file"))))


def _int(value: Any, default: int = 0) -> int:
    """A count from a payload; anything that is not one gives `default`."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _deliver_inputs(state: AgentState) -> None:
    """A model turn was recorded: the inputs consumed for it join the history."""
    keep = []
    for item in state.inputs:
        if item.consumed_turn is not None and item.consumed_turn <= state.turn:
            _remember(state, {"turn": state.turn, "input": item.kind, "id": item.ident,
                              "sha256": item.sha256, "chars": item.chars, "file": item.file})
        else:
            keep.append(item)
    state.inputs = keep


def _spent(value: object) -> float:
    """A usage figure as a charge: a finite number >= 0, anything else 0 (a
    negative charge would give budget back; a malformed one must not stop the
    fold)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value) if 0 <= value < float("inf") else 0.0


def _apply(state: AgentState, event: str, p: dict[str, Any]) -> None:
    match event:
        case "session_start":
            state.segment += 1
            spec = p.get("spec_session")
            if isinstance(spec, str) and _SESSION_ID.fullmatch(spec) and (
                    state.spec_session is None or spec > state.spec_session):
                state.spec_session = spec
            state.phase = "running"
            state.exit_reason = None
        case "turn":
            state.turn = int(p.get("turn", state.turn + 1))
            state.model_calls += 1
            usage = p.get("usage") or {}
            state.budget.tokens_used += int(usage.get("tokens_in", 0)) + int(
                usage.get("tokens_out", 0))
            state.budget.cost_used += float(usage.get("cost_units", 0.0))
            actions = p.get("actions") or []
            state.calls = {}
            state.actions = list(actions)
            state.open_turn = state.turn if actions else None
            _deliver_inputs(state)
            state.pipeline = pipeline_track.on_turn(state.pipeline, p.get("pipeline"))
            if p.get("text"):
                _remember(state, {"turn": state.turn, "text": str(p["text"])[:RECENT_RESULT_CHARS]})
        case "tool_call":
            cid = str(p.get("call_id"))
            if state.open_turn is None or cid in state.calls:
                return
            state.calls[cid] = Call(call_id=cid, index=int(p.get("index", 0)), op=p.get("op"))
            state.counts.tool_calls += 1
            state.last_op = p.get("op") or "invalid"
        case "schema_reject":
            call = state.calls.get(str(p.get("call_id")))
            if call is None or call.settled:
                return
            call.settled, call.status = True, "rejected"
            state.counts.rejects += 1
            pipeline_track.on_settled(state.pipeline, call.index, "rejected", p.get("errors"))
            state.cursor += 1
            _remember(state, {"turn": state.turn, "call_id": call.call_id,
                              "action": _action(state, call), "status": "rejected",
                              "result": {"errors": p.get("errors", [])}})
            _close_turn_if_settled(state)
        case "permission":
            call = state.calls.get(str(p.get("call_id")))
            if call is not None:
                call.verdict, call.rule = p.get("decision"), p.get("rule")
                call.request = p.get("request")
        case "approval_requested":
            request = str(p.get("request"))
            if str(p.get("call_id")) in state.calls and request not in state.approvals:
                state.approvals[request] = Approval(
                    request=request, call_id=str(p["call_id"]), op=str(p.get("op")),
                    pattern=str(p.get("pattern", "*")), kind=str(p.get("kind", "permission")),
                    question=p.get("question"))
        case "approval_answer":
            approval = state.approvals.get(str(p.get("request")))
            if approval is None or approval.status != "pending" or \
                    approval.kind == "clarification":
                return  # an approval never answers a question
            approved = p.get("decision") == "approve"
            approval.status = "approved" if approved else "denied"
            approval.always = bool(p.get("always")) and approved
            approval.note = p.get("note")
            grant = (approval.op, approval.pattern)
            if approval.always and approval.kind == "permission" and grant not in state.grants:
                state.grants.append(grant)
                state.grants.sort()
        case "operator_answer":
            approval = state.approvals.get(str(p.get("request")))
            if approval is None or approval.status != "pending" or \
                    approval.kind != "clarification":
                return  # an answer never grants a permission
            approval.status = "answered"
            _add_input(state, "answer", approval.request, p)
        case "operator_correction":
            if state.phase in ("finished", "closed") or any(
                    i.kind == "correction" and i.consumed_turn is None for i in state.inputs):
                return  # one pending correction at a time; none after the session's end
            state.corrections += 1
            _add_input(state, "correction", str(p.get("correction")), p)
        case "clarification_consumed" | "correction_consumed":
            kind = "answer" if event == "clarification_consumed" else "correction"
            ident = str(p.get("request" if kind == "answer" else "correction"))
            for item in state.inputs:
                if item.kind == kind and item.ident == ident and item.consumed_turn is None:
                    item.consumed_turn = _int(p.get("turn"), state.turn + 1)
        case "tool_start":
            call = state.calls.get(str(p.get("call_id")))
            if call is not None:
                call.started = True
                call.effect = p.get("effect")
        case "tool_result":
            call = state.calls.get(str(p.get("call_id")))
            if call is None or call.settled:
                return
            call.settled, call.status = True, str(p.get("status"))
            state.counts.tool_results += 1
            pipeline_track.on_settled(state.pipeline, call.index, call.status, p.get("result"))
            state.cursor += 1
            _remember(state, {"turn": state.turn, "call_id": call.call_id,
                              "action": _action(state, call), "status": call.status,
                              "result": _clip(p.get("result"))})
            _close_turn_if_settled(state)
        case "todos":
            items = p.get("items")
            if isinstance(items, list):
                state.todos = items
        case "turn_aborted":
            if p.get("turn") != state.open_turn or state.open_turn is None:
                return  # late or stale: that turn is already closed
            for item in p.get("calls") or []:
                applied = isinstance(item, dict) and item.get("effect_applied") is True
                aborted = state.calls.get(str(item.get("call_id"))) if isinstance(
                    item, dict) else None
                if aborted is not None:
                    pipeline_track.on_aborted(state.pipeline, aborted.index, applied)
                state.counts.aborted += 1
                if applied:
                    state.cursor += 1
                _remember(state, {"turn": state.turn, "call_id": item.get("call_id"),
                                  "status": "aborted", "result": {
                                      "effect_applied": item.get("effect_applied")}})
            _close_turn(state)
        case "session_exit":
            reason = str(p.get("reason"))
            state.exit_reason = reason
            state.phase = ("finished" if reason == "finished"
                           else "paused" if reason == "budget" else "closed")
        case "compaction_recorded":
            ident = f"m{state.compactions + 1}"
            if state.compaction_pending is None and p.get("compaction") == ident:
                state.compactions += 1
                state.compaction_pending = Compaction(
                    compaction=ident, items=max(0, _int(p.get("items"))),
                    through_turn=_int(p.get("through_turn")), sha256=str(p.get("sha256")),
                    chars=_int(p.get("chars")), tokens=_int(p.get("summary_tokens")))
                usage = p.get("usage")
                if isinstance(usage, dict):  # the summary's model call counts into the budget
                    state.budget.tokens_used += _int(usage.get("tokens_in")) + _int(
                        usage.get("tokens_out"))
        case "compaction_boundary":
            pending = state.compaction_pending
            if pending is None or p.get("compaction") != pending.compaction:
                return  # an orphaned or stale boundary changes nothing
            del state.recent[: pending.items]
            state.summary, state.compaction_pending = pending, None
        case "compaction_abandoned":
            if state.compaction_pending is not None and \
                    p.get("compaction") == state.compaction_pending.compaction:
                state.compaction_pending = None
        # a child's model use counts into its parent's budget, a run of its schedule's
        # into its owner's (schedule_usage: supervisor/automationgrants.py)
        case "subagent_usage" | "schedule_usage":
            state.budget.tokens_used += int(_spent(p.get("tokens")))
            state.budget.cost_used += _spent(p.get("cost_units"))
        case "budget_resumed":
            state.budget.extra_tokens += int(p.get("tokens", 0))
            state.budget.extra_cost += float(p.get("cost_units", 0.0))
        case _:
            return
