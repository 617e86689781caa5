"""The `openai`-library backend against a local fake server (tests/
test_openai_backend.py's): a 429 with Retry-After then success (the wait
honoured, the server's usage counted), a slow answer within the deadline
while the agent's pulse goes on beating (a real ROUTER socket), the key never
in an error, the context carrying a compaction's summary and operator inputs,
and a summary made by the configured summary model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.agent.openai_backend import OpenAIModel, build_messages
from actors.kernel import compaction, operator_input
from actors.kernel.settings import CompactionSettings, OpenAISettings, Task
from actors.kernel.state import AgentState
from broker import protocol
from broker.control import ControlReporter
from broker.errors import ModelError
from tests.processes import wait_for
from tests.test_openai_backend import Server, call, completion

KEY = "sk-never-logged-7f3a"


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    srv.thread.start()
    yield srv
    srv.release.set()
    srv.httpd.shutdown()
    srv.httpd.server_close()


def test_a_429_waits_its_retry_after_then_succeeds_with_server_usage(server: Server) -> None:
    server.script += [(429, {"error": "slow down"}), (200, completion([call("finish", "{}")]))]
    sleeps: list[float] = []
    model = OpenAIModel(OpenAISettings(base_url=server.base_url, backoff_cap_s=2.0),
                        Task(prompt="p"), sleep=sleeps.append)
    reply = model.next_reply(AgentState())
    assert reply.actions == [{"op": "finish"}] and len(server.requests) == 2
    assert sleeps == [0.5]  # no Retry-After header from this server: base backoff
    assert (reply.usage.tokens_in, reply.usage.tokens_out) == (120, 30)


def test_exhausted_retries_name_the_server_never_the_key(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_TEST_KEY", KEY)
    server.script += [(503, {"error": KEY})] * 2
    model = OpenAIModel(OpenAISettings(base_url=server.base_url, api_key_env="CORRAL_TEST_KEY",
                                       max_retries=1), Task(prompt="p"), sleep=lambda _s: None)
    with pytest.raises(ModelError) as caught:
        model.next_reply(AgentState())
    assert "HTTP 503" in str(caught.value) and KEY not in str(caught.value)
    assert {k.lower(): v for k, v in server.headers[0].items()}["authorization"] == f"Bearer {KEY}"


def test_a_slow_answer_within_the_deadline_while_heartbeats_go_on(
        server: Server, tmp_path: Path) -> None:
    """The server holds its answer until the agent's pulse has beaten through the
    call for a while (busy `model`), then answers: one attempt, a reply."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/sup.sock"
    sock.bind(endpoint)
    reporter = ControlReporter(ctx, endpoint, "agent-1", 0.05, pulse=True, stall_s=0.2)
    model = OpenAIModel(OpenAISettings(base_url=server.base_url, timeout_s=10.0, max_retries=0),
                        Task(prompt="p"))
    beats: list[protocol.Heartbeat] = []
    gate = threading.Event()
    handler = server.httpd.RequestHandlerClass
    answer = handler.do_POST  # type: ignore[attr-defined]

    def slow_post(request: Any) -> None:
        gate.wait(15)  # slow: the answer comes once the beats were seen
        server.script.append((200, completion([call("finish", "{}")])))
        answer(request)

    def busy_beats() -> bool:
        while sock.poll(0):
            message = protocol.decode(sock.recv_multipart()[1])
            if isinstance(message, protocol.Heartbeat) and message.busy is not None:
                beats.append(message)
        return len(beats) >= 5 and beats[-1].busy is not None and beats[-1].busy.since_s > 0.3

    handler.do_POST = slow_post  # type: ignore[attr-defined]
    watcher = threading.Thread(target=lambda: (wait_for(busy_beats, 15, "busy beats"),
                                               gate.set()))
    try:
        reporter.ready()
        watcher.start()
        started = time.monotonic()
        with reporter.busy("model", model.deadline_s):
            reply = model.next_reply(AgentState())
        watcher.join()
        assert reply.actions == [{"op": "finish"}] and model.attempts == 1
        assert time.monotonic() - started < model.deadline_s
        assert {b.busy.op for b in beats if b.busy} == {"model"}
    finally:
        gate.set()
        handler.do_POST = answer  # type: ignore[attr-defined]
        reporter.close()
        sock.close()
        ctx.destroy(linger=0)


def test_context_carries_summary_and_inputs_and_summary_model_is_used(
        server: Server, tmp_path: Path) -> None:
    agent_dir = tmp_path / "agent"
    ref = operator_input.write_text(agent_dir, "answer", "req-1.0", "blue")
    state = AgentState(recent=[
        {"turn": 2, "input": "answer", "id": "req-1.0", **ref},
        {"turn": 2, "call_id": "2.0", "action": {"op": "finish"}, "status": "ok", "result": {}}])
    now = operator_input.Delivered("correction", "k1", "use green", "x")
    messages = build_messages(Task(prompt="p"), state, None, agent_dir=agent_dir,
                              summary="earlier: turns 1-1", inputs=[now])
    texts = [str(m.get("content")) for m in messages]
    assert "earlier: turns 1-1" in texts[2] and texts[3].endswith(":\nblue")
    assert texts[-1].endswith(":\nuse green") and "k1" in texts[-1]
    server.script.append((200, completion(None, content="S" * 50)))
    model = OpenAIModel(OpenAISettings(base_url=server.base_url), Task(prompt="p"),
                        compaction=CompactionSettings(window_tokens=16_000,
                                                      summary_model="small-summarizer"))
    summary = compaction.summarize(model, _nothing, None, state.recent, 20)
    assert summary.text == "S" * 20 and summary.method == "model:small-summarizer"
    assert server.requests[0]["model"] == "small-summarizer" and summary.tokens_in == 120


class _nothing:  # noqa: N801 - a do-nothing context manager
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
