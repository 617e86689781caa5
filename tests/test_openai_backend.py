"""The OpenAI-compatible backend against a local HTTP server the test starts
(127.0.0.1, port chosen by the OS): tool calls become actions (bad arguments
become an action the loop rejects), a 500 is retried and the success used,
a timeout is retried and then reported as ModelError."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from actors.agent import catalog
from actors.agent.openai_backend import OpenAIModel
from actors.kernel.ops import Rejected
from actors.kernel.settings import OpenAISettings, Task
from actors.kernel.state import AgentState
from broker.errors import ModelError

catalog.install()  # the ops these tests parse and run (a process does it at start)


class Server:
    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, Any] | None]] = []  # (status, body|None=hang)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                outer.requests.append(json.loads(self.rfile.read(length)))
                outer.headers.append(dict(self.headers))
                status, body = outer.script.pop(0) if outer.script else (500, {})
                if body is None:  # hang until the test ends: the client must time out
                    outer.release.wait(30)
                    return
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    srv.thread.start()
    yield srv
    srv.release.set()
    srv.httpd.shutdown()
    srv.httpd.server_close()


def completion(tool_calls: list[dict[str, Any]] | None = None, content: str | None = None
               ) -> dict[str, Any]:
    return {"choices": [{"message": {"role": "assistant", "content": content,
                                     "tool_calls": tool_calls}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 30}}


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def model(server: Server, **kw: Any) -> tuple[OpenAIModel, list[float]]:
    sleeps: list[float] = []
    settings = OpenAISettings(base_url=server.base_url, model="test-model", **kw)
    return OpenAIModel(settings, Task(prompt="do it"), sleep=sleeps.append), sleeps


def test_tool_calls_become_actions(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    server.script.append((200, completion([
        call("write_file", json.dumps({"path": "a.md", "content": "hi"})),
        call("edit_file", "{not json"),
    ])))
    backend, _ = model(server)
    reply = backend.next_reply(AgentState())
    assert reply.actions[0] == {"op": "write_file", "path": "a.md", "content": "hi"}
    assert not isinstance(catalog.parse_action(reply.actions[0]), Rejected)
    assert isinstance(catalog.parse_action(reply.actions[1]), Rejected)
    assert (reply.usage.tokens_in, reply.usage.tokens_out) == (120, 30)
    sent = server.requests[0]
    assert sent["model"] == "test-model"
    assert {t["function"]["name"] for t in sent["tools"]} >= {"read_file", "finish", "ask"}
    assert {k.lower(): v for k, v in server.headers[0].items()}["authorization"] == "Bearer sk-test"


def test_a_500_is_retried_then_the_success_is_used(server: Server) -> None:
    server.script += [(500, {"error": "boom"}), (200, completion([call("finish", "{}")]))]
    backend, sleeps = model(server, backoff_base_s=0.25)
    reply = backend.next_reply(AgentState())
    assert reply.actions == [{"op": "finish"}]
    assert len(server.requests) == 2 and sleeps == [0.25]


def test_a_timeout_is_retried_then_reported(server: Server) -> None:
    server.script += [(200, None), (200, None)]
    backend, sleeps = model(server, timeout_s=0.3, max_retries=1)
    with pytest.raises(ModelError, match="timeout"):
        backend.next_reply(AgentState())
    assert backend.attempts == 2 and len(sleeps) == 1


def test_a_4xx_is_not_retried(server: Server) -> None:
    server.script.append((401, {"error": "bad key"}))
    backend, sleeps = model(server)
    with pytest.raises(ModelError, match="401"):
        backend.next_reply(AgentState())
    assert backend.attempts == 1 and sleeps == []


def test_text_only_reply_has_no_actions(server: Server) -> None:
    server.script.append((200, completion(None, content="thinking out loud")))
    backend, _ = model(server)
    reply = backend.next_reply(AgentState())
    assert reply.actions == [] and reply.text == "thinking out loud"
