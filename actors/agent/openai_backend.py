"""An OpenAI-compatible chat-completions backend with tool calling.

Builds the context from the state alone; owns retries, the call deadline and
the API key (never logged). See docs/agents.md ("Model backends",
"Long calls").
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import openai

from actors.agent import catalog, mcp_functions
from actors.kernel.compaction import Summary, SummaryCache
from actors.kernel.operator_input import Delivered, read_text
from actors.kernel.reply import Reply, Usage
from actors.kernel.settings import CompactionSettings, OpenAISettings, Task
from actors.kernel.state import AgentState
from broker.errors import ModelError

# the HTTP package under the library (httpx, or httpx2 in later versions): its errors
# can surface while a streamed body is read
_HTTP = sys.modules[next(c.__module__ for c in openai.DefaultHttpxClient.__mro__
                         if c.__module__.startswith("httpx")).split(".")[0]]
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
READ_CHUNK_BYTES = 64 * 1024
NO_KEY = "no-key"  # the library insists on a key; a local server ignores this one
INPUT_LABEL = {"answer": "The operator's answer to your question {id}",
               "correction": "A correction from the operator ({id})"}


class ModelTimeoutError(ModelError):
    """The model call ended at its deadline: its last attempt timed out, or the
    whole call (attempts and backoffs) outlasted `call_deadline_s()`."""


class _Retry(Exception):  # noqa: N818 - internal signal, never leaves this module
    def __init__(self, last: str, retry_after: float | None = None, timed_out: bool = False
                 ) -> None:
        super().__init__(last)
        self.last, self.retry_after, self.timed_out = last, retry_after, timed_out


def _input_message(kind: str, ident: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": f"{INPUT_LABEL.get(kind, kind).format(id=ident)}:\n{text}"}


def build_messages(task: Task, state: AgentState, window: int | None, *,
                   agent_dir: Path | None = None, summary: str | None = None,
                   inputs: Sequence[Delivered] = ()) -> list[dict[str, Any]]:
    """The request's messages; `window` None: every exchange the state keeps."""
    system = (
        "You are an agent working in a sandboxed workspace. Act only through the tools. "
        "Paths are relative to the workspace. Call `finish` when the task is done.\n\n"
        f"Task: {task.prompt or task.name}"
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": task.prompt or task.name}]
    if summary is not None:
        messages.append({"role": "user", "content": "Summary of the session so far "
                                                    f"(earlier exchanges compacted):\n{summary}"})
    items = state.recent if window is None else state.recent[-window:]
    for item in items:
        if "input" in item:
            text = (read_text(agent_dir, str(item.get("file")), str(item.get("sha256")))
                    if agent_dir is not None else "[operator input not available]")
            messages.append(_input_message(str(item["input"]), str(item.get("id")), text))
            continue
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
    messages.extend(_input_message(i.kind, i.ident, i.text) for i in inputs)
    return messages


def parse_reply(body: dict[str, Any]) -> Reply:
    """Actions, text and usage from a chat-completions response body."""
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelError("chat completion without choices[0].message") from exc
    if not isinstance(message, dict):
        raise ModelError("chat completion whose choices[0].message is not an object")
    actions: list[Any] = []
    for call in message.get("tool_calls") or []:
        function = (call.get("function") if isinstance(call, dict) else None) or {}
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
    tokens_in, tokens_out = _usage(body)
    content = message.get("content")
    return Reply(actions=actions, text=content if isinstance(content, str) and content else None,
                 usage=Usage(tokens_in, tokens_out, (tokens_in + tokens_out) / 1000))


def _usage(body: dict[str, Any]) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    assert isinstance(usage, dict)

    def count(value: Any) -> int:
        return value if isinstance(value, int) and value >= 0 else 0

    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


class OpenAIModel:
    name = "openai"

    def __init__(self, settings: OpenAISettings, task: Task, model: str | None = None,
                 window: int = 20, sleep: Any = time.sleep, *, agent_dir: Path | None = None,
                 compaction: CompactionSettings | None = None) -> None:
        self.settings = settings
        self.task = task
        self.model = model or settings.model
        self.compaction = compaction or CompactionSettings()
        self.window: int | None = None if self.compaction.window_tokens else window
        self.sleep = sleep
        self.agent_dir = agent_dir
        # the MCP servers' registry (actors/registries/store.py) is under
        # <root>/config; agent_dir is <root>/agents/<name>
        self.config_dir = (agent_dir.parent.parent / "config" if agent_dir is not None
                           else None)
        self.summaries = SummaryCache(agent_dir) if agent_dir is not None else None
        parts = urlsplit(settings.base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ModelError(f"invalid base_url {settings.base_url!r}")
        # named in every failure (without any user:password part of the URL)
        self.url = f"{parts.scheme}://{parts.hostname}" + (
            f":{parts.port}" if parts.port else "") + parts.path
        self.attempts = 0
        self.deadline_s = settings.call_deadline_s()  # the loop declares it as the call's
        self._client = openai.OpenAI(
            api_key=os.environ.get(settings.api_key_env) or NO_KEY,
            base_url=settings.base_url.rstrip("/"), max_retries=0, timeout=settings.timeout_s)

    def next_reply(self, state: AgentState, inputs: Sequence[Delivered] = ()) -> Reply:
        summary = self.summaries.get(state.summary) if self.summaries is not None else None
        messages = build_messages(self.task, state, self.window, agent_dir=self.agent_dir,
                                  summary=summary, inputs=inputs)
        offer = (mcp_functions.offer(mcp_functions.installed(self.config_dir), self.agent_dir)
                 if self.config_dir is not None and self.agent_dir is not None
                 else mcp_functions.Offer())
        body = {"model": self.model, "temperature": self.settings.temperature,
                "messages": messages, "tools": catalog.tool_schemas() + offer.functions,
                "tool_choice": "auto"}
        self.last_request = body  # the session's transcript records both (actors/sessions)
        self.last_response = self.complete(body)
        reply = parse_reply(self.last_response)
        if not offer.targets:
            return reply
        return dataclasses.replace(reply, actions=[mcp_functions.to_action(a, offer.targets)
                                                   for a in reply.actions])

    def summarize(self, previous: str | None, items: Sequence[dict[str, Any]],
                  limit: int) -> Summary:
        """A summary of `items` (and the summary before them) by the summary model."""
        model = self.compaction.summary_model or self.model
        prompt = (f"Summarize this part of an agent's session in at most {limit} characters: "
                  "the decisions, what was changed, what was learnt and what is still open. "
                  "Plain text.")
        body = json.dumps({"previous_summary": previous, "exchanges": list(items)},
                          ensure_ascii=False, default=str)
        reply = self.complete({"model": model, "temperature": 0.0, "messages": [
            {"role": "system", "content": prompt}, {"role": "user", "content": body}]})
        parsed = parse_reply(reply)
        return Summary((parsed.text or "")[:limit], f"model:{model}",
                       parsed.usage.tokens_in, parsed.usage.tokens_out)

    # --- one call: attempts, backoffs, the deadline ------------------------------------
    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /chat/completions through the library, within the call's deadline."""
        last = "no attempt"
        until = time.monotonic() + self.deadline_s
        timed_out = False
        for attempt in range(self.settings.max_retries + 1):
            self.attempts += 1
            attempt_until = min(until, time.monotonic() + self.settings.timeout_s)
            try:
                return self._attempt(body, attempt_until, until)
            except _Retry as retry:
                last, timed_out = retry.last, retry.timed_out
                retry_after = retry.retry_after
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

    def _attempt(self, body: dict[str, Any], attempt_until: float, until: float
                 ) -> dict[str, Any]:
        timeout = max(0.001, attempt_until - time.monotonic())
        create = cast(Any, self._client.chat.completions.with_streaming_response.create)
        try:
            with create(**body, timeout=timeout) as response:
                chunks: list[bytes] = []
                for chunk in response.iter_bytes():
                    if time.monotonic() > attempt_until:
                        if time.monotonic() > until:
                            raise ModelTimeoutError(
                                f"model call ended at its deadline of {self.deadline_s:g}s")
                        raise _Retry(f"timeout after {self.settings.timeout_s:g}s",
                                     timed_out=True)
                    chunks.append(chunk)
        except openai.APIStatusError as exc:
            status = exc.status_code
            if status not in RETRY_STATUS:
                raise ModelError(f"the model server {self.url} answered HTTP {status}: "
                                 f"{exc.response.content[:200]!r}") from None
            header = exc.response.headers.get("Retry-After", "")
            raise _Retry(f"HTTP {status}", float(header) if header.strip().isdigit() else None
                         ) from None
        except (openai.APITimeoutError, _HTTP.TimeoutException):
            raise _Retry(f"timeout after {self.settings.timeout_s:g}s", timed_out=True) from None
        except (openai.APIConnectionError, _HTTP.HTTPError, OSError) as exc:
            raise _Retry(f"{type(exc).__name__}") from None
        try:
            parsed = json.loads(b"".join(chunks))
        except ValueError as exc:
            raise ModelError(f"the model server {self.url} sent invalid JSON") from exc
        if not isinstance(parsed, dict):
            raise ModelError(f"the model server {self.url} sent a non-object body")
        return parsed
