"""An agent cannot answer its own question or correct itself: over its own
authenticated writer connection (its credential, its own stream), an
`operator_answer` or `operator_correction`, alone or inside an `append_many`
group, is refused (`forbidden`) and nothing is written; no connection without
a credential gets an answer at all; the operator's credential answers, and the
fold takes only that. A consumption fact the agent writes for an input that
was never recorded delivers nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import zmq

from actors.kernel.operator_input import record_answer
from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker import auth, protocol
from broker.errors import RemoteError
from broker.statedir import StateDir
from tests.processes import ProcessTracker
from tests.security.test_auth import forged, handshake_refused
from tests.test_writer import start_writer

pytestmark = pytest.mark.process
Ctx = zmq.Context[zmq.Socket[bytes]]
STREAM = "agent/agent-1"


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def body(payload: dict[str, object]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def test_an_agent_cannot_forge_an_answer_or_a_correction(
        processes: ProcessTracker, state_dir: StateDir, ctx: Ctx) -> None:
    start_writer(processes, state_dir, ctx)
    keyring = auth.ensure_keys(state_dir)
    agent = WriterClient(ctx, state_dir, "agent-1", credential=keyring.credential("agent-1"),
                         timeout_s=2, retries=0)
    operator = WriterClient(ctx, state_dir, "operator",
                            credential=auth.operator_credential(state_dir))
    try:
        # the agent's own facts: a session whose one call asks the operator a question
        for key, event, payload in [
            ("s1:start", "session_start", {"segment": 1}),
            ("t1:turn", "turn", {"turn": 1, "actions": [{"op": "ask", "question": "go?"}]}),
            ("c1.0", "tool_call", {"call_id": "1.0", "turn": 1, "index": 0, "op": "ask"}),
            ("c1.0:perm", "permission", {"call_id": "1.0", "op": "ask", "decision": "ask",
                                         "rule": "operator", "request": "req-1.0"}),
            ("c1.0:req", "approval_requested", {"request": "req-1.0", "call_id": "1.0",
                                                "op": "ask", "pattern": "*",
                                                "kind": "clarification", "question": "go?"}),
        ]:
            agent.append(STREAM, event, payload, key=key)
        answer = {"request": "req-1.0", "sha256": "0" * 64, "chars": 3,
                  "file": "answer-req-1.0-000000000000.txt"}
        correction = {"correction": "k1", "sha256": "0" * 64, "chars": 3,
                      "file": "correction-k1-000000000000.txt"}
        for i, (event, payload) in enumerate([("operator_answer", answer),
                                              ("operator_correction", correction)]):
            with pytest.raises(RemoteError) as caught:
                agent.append(STREAM, event, payload, key=f"forged{i}")
            assert caught.value.code == "forbidden"
            with pytest.raises(RemoteError) as caught:  # hidden in a group of its own facts
                agent.append_many(STREAM, [
                    ("todos", body({"items": []}), f"g{i}.0", None),
                    (event, body(payload), f"g{i}.1", None)])
            assert caught.value.code == "forbidden"
            # no credential at all: refused at the handshake, never delivered
            handshake_refused(ctx, state_dir.endpoint("writer"), [protocol.encode(forged(
                event, STREAM, "operator", f"anon{i}", body(payload)))])
        # a consumption for an input never recorded: allowed (its own stream), no effect
        agent.append(STREAM, "clarification_consumed", {"request": "req-1.0", "turn": 2},
                     key="t2:in:answer:req-1.0")
        state = rebuild(operator, state_dir, "agent-1").state
        assert [e for e in (r.event for r in operator.read_stream(STREAM))
                if e.startswith("operator_")] == []
        assert state.inputs == [] and state.approvals["req-1.0"].status == "pending"
        # the operator's credential answers; the fold takes it
        record_answer(operator, state_dir.agent_dir("agent-1"), "agent-1", state, "req-1.0",
                      text="yes, go")
        state = rebuild(operator, state_dir, "agent-1").state
        assert state.approvals["req-1.0"].status == "answered"
        assert [i.ident for i in state.inputs] == ["req-1.0"]
    finally:
        agent.close()
        operator.close()
