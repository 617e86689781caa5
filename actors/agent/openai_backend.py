"""An OpenAI-compatible chat-completions backend (Ollama, vLLM, llama.cpp
server, hosted APIs), with tool calling, on the standard library's http.client.

The context is built from the state alone: a system message (the task's
prompt and the rules of the game), then the recent exchanges the fold keeps
(each action as an assistant tool call, each result as a tool message), so a
restarted agent sends the same context. Every registered op is offered as a
function (its pydantic schema). A reply's tool calls become raw actions
(`{"op": name, **arguments}`); arguments that are not a JSON object become an
action the loop rejects (`schema_reject`), never an exception.

Timeouts per request (`timeout_s`); 429 and 5xx answers, timeouts and
connection errors are retried `max_retries` times with exponential backoff
(`backoff_base_s * 2**n`, capped, honouring a numeric Retry-After up to the
cap); then ModelError. The whole call has a deadline
(`OpenAISettings.call_deadline_s()`):
every attempt's timeout plus every backoff; a server that trickles its answer
past it gets ModelTimeoutError (the body is read in chunks against the
deadline, not only per socket read). The agent's heartbeats go on during the
call up to that deadline (docs/agents.md, "Long calls"). The key is read from
the environment variable named by `api_key_env` and never logged.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from actors.agent import catalog
from actors.agent.backends import Reply, Usage
from actors.agent.operator_input import Delivered
from actors.agent.settings import OpenAISettings, Task
from actors.agent.state import AgentState
from broker.errors import ModelError

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
READ_CHUNK_BYTES = 64 * 1024


class ModelTimeoutError(ModelError):
    """The model call ended at its deadline: its last attempt timed out, or the
    whole call (attempts and backoffs) outlasted `call_deadline_s()`."""




def build_messages(task: Task, state: AgentState, window: int) -> list[dict[str, Any]]:
    system = (
        "You are an agent working in a sandboxed workspace. Act only through the tools. "
        "Paths are relative to the workspace. Call `finish` when the task is done.\n\n"
        f"Task: {task.prompt or task.name}"
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": task.prompt or task.name}]
    for item in state.recent[-window:]:
        if "text" in item and "call_id" not in item:
            messages.append({"role": "assistant", "content": str(item["text"])})
            continue
        call_id = str(item.get("call_id"))
        action = item.get("action")
        if isinstance(action, dict):
            name = str(action.get("op", "unknown"))
            args = {k: v for k, v in action.items() if k != "op"}
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(
                {"status": item.get("status"), "result": item.get("result")})})
        else:
            messages.append({"role": "user", "content": json.dumps(
                {"call_id": call_id, "status": item.get("status"), "result": item.get("result")})})
    return messages


def parse_reply(body: dict[str, Any]) -> Reply:
    """Actions, text and usage from a chat-completions response body."""
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelError("chat completion without choices[0].message") from exc
    actions: list[Any] = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name = function.get("name")
        raw = function.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = None
        if isinstance(args, dict):
            actions.append({**args, "op": name})
        else:
            actions.append({"op": name, "arguments_not_an_object": True})
    usage = body.get("usage") or {}
    tokens_in = int(usage.get("prompt_tokens") or 0)
    tokens_out = int(usage.get("completion_tokens") or 0)
    return Reply(actions=actions, text=message.get("content") or None,
                 usage=Usage(tokens_in, tokens_out, (tokens_in + tokens_out) / 1000))


class OpenAIModel:
    name = "openai"

    def __init__(self, settings: OpenAISettings, task: Task, model: str | None = None,
                 window: int = 20, sleep: Any = time.sleep) -> None:
        self.settings = settings
        self.task = task
        self.model = model or settings.model
        self.window = window
        self.sleep = sleep
        parts = urlsplit(settings.base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ModelError(f"invalid base_url {settings.base_url!r}")
        self.parts = parts
        # named in every failure (without any user:password part of the URL)
        self.url = f"{parts.scheme}://{parts.hostname}" + (
            f":{parts.port}" if parts.port else "") + parts.path
        self.attempts = 0
        self.deadline_s = settings.call_deadline_s()  # the loop declares it as the call's

    def next_reply(self, state: AgentState, inputs: Sequence[Delivered] = ()) -> Reply:
        body = {"model": self.model, "temperature": self.settings.temperature,
                "messages": build_messages(self.task, state, self.window),
                "tools": catalog.tool_schemas(), "tool_choice": "auto"}
        return parse_reply(self.post("/chat/completions", body))

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = (http.client.HTTPSConnection if self.parts.scheme == "https"
               else http.client.HTTPConnection)
        return cls(self.parts.hostname or "", self.parts.port, timeout=timeout_s)

    def _read(self, response: http.client.HTTPResponse, until: float) -> bytes:
        """The body, in chunks, ending with ModelTimeoutError at `until` (monotonic)."""
        chunks: list[bytes] = []
        while True:
            if time.monotonic() > until:
                raise ModelTimeoutError(f"model call ended at its deadline of {self.deadline_s:g}s")
            chunk = response.read1(READ_CHUNK_BYTES)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.settings.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        last = "no attempt"
        started = time.monotonic()
        until = started + self.deadline_s
        for attempt in range(self.settings.max_retries + 1):
            self.attempts += 1
            retry_after: float | None = None
            timed_out = False
            attempt_until = min(until, time.monotonic() + self.settings.timeout_s)
            conn = self._connection(max(0.001, attempt_until - time.monotonic()))
            try:
                conn.request("POST", self.parts.path + path, body=data, headers=headers)
                response = conn.getresponse()
                try:
                    payload = self._read(response, attempt_until)
                except ModelTimeoutError:
                    if time.monotonic() > until:
                        raise
                    raise TimeoutError from None  # this attempt's timeout: retried
                if response.status == 200:
                    try:
                        parsed = json.loads(payload)
                    except ValueError as exc:
                        raise ModelError(f"the model server {self.url} sent invalid JSON") \
                            from exc
                    if not isinstance(parsed, dict):
                        raise ModelError(f"the model server {self.url} sent a non-object body")
                    return parsed
                last = f"HTTP {response.status}"
                if response.status not in RETRY_STATUS:
                    raise ModelError(f"the model server {self.url} answered {last}: "
                                     f"{payload[:200]!r}")
                header = response.getheader("Retry-After")
                if header and header.strip().isdigit():
                    retry_after = float(header)
            except TimeoutError:
                last = f"timeout after {self.settings.timeout_s:g}s"
                timed_out = True
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
            if attempt < self.settings.max_retries:
                delay = min(self.settings.backoff_cap_s,
                            retry_after if retry_after is not None
                            else self.settings.backoff_base_s * 2 ** attempt)
                self.sleep(max(0.0, min(delay, until - time.monotonic())))
        if timed_out or time.monotonic() > until:
            raise ModelTimeoutError(f"model call to {self.url} ended at its deadline of "
                                    f"{self.deadline_s:g}s after "
                                    f"{self.settings.max_retries + 1} attempts: {last}")
        raise ModelError(f"model server {self.url} failed after "
                         f"{self.settings.max_retries + 1} attempts: {last}")
