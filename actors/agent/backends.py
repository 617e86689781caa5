"""Model backends behind one interface: the agent's state in, the next reply out.

`scripted` (a task file's steps, from the state's cursor; `{i}`,
`{last_command}` and `{last_terminal}` are filled in), `replay` and `openai`.
Actions are validated by the loop, never here.
See docs/agents.md ("Model backends").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from actors.kernel.operator_input import Delivered
from actors.kernel.reply import Backend, Reply, Usage
from actors.kernel.settings import AgentSpec, Task
from actors.kernel.state import AgentState


def echo(inputs: Sequence[Delivered]) -> str | None:
    """What a scripted model says it received: each input's kind, identity and the
    sha256 of the text it was given (never the text: turn records are WAL facts),
    so a test can count deliveries and check the text arrived intact."""
    if not inputs:
        return None
    return "received " + "; ".join(
        f"{i.kind} {i.ident} sha256={hashlib.sha256(i.text.encode()).hexdigest()}"
        for i in inputs)


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str))


def estimate_usage(state: AgentState, actions: list[Any]) -> Usage:
    """Deterministic token figures for backends without a tokenizer (~4 chars a token)."""
    last = state.recent[-1] if state.recent else {}
    tokens_in = 50 + _size(last) // 4
    tokens_out = 1 + _size(actions) // 4
    return Usage(tokens_in, tokens_out, (tokens_in + tokens_out) / 1000)


NO_PROC = {"{last_command}": "p-0000000000000000", "{last_terminal}": "t-0000000000000000"}


def _last_procs(state: AgentState) -> dict[str, str]:
    """The placeholders' values: the newest proc ids named by recent results."""
    found = dict(NO_PROC)
    prefixes = {"p-": "{last_command}", "t-": "{last_terminal}"}
    for item in state.recent:
        result = item.get("result")
        proc_id = result.get("proc_id") if isinstance(result, dict) else None
        if isinstance(proc_id, str) and proc_id[:2] in prefixes:
            found[prefixes[proc_id[:2]]] = proc_id
    return found


def _names_procs(step: Any) -> bool:
    """Whether a script step uses `{last_command}` or `{last_terminal}`."""
    text = json.dumps(step, ensure_ascii=False, default=str)
    return any(placeholder in text for placeholder in NO_PROC)


def _substitute(value: Any, values: dict[str, str]) -> Any:
    if isinstance(value, str):
        for placeholder, text in values.items():
            value = value.replace(placeholder, text)
        return value
    if isinstance(value, list):
        return [_substitute(v, values) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, values) for k, v in value.items()}
    return value


class ScriptedModel:
    name = "scripted"

    def __init__(self, task: Task) -> None:
        self.setup = task.setup
        self.steps = task.steps
        self.total = len(task.setup) + len(task.steps) * task.repeat
        self._setup_procs = [_names_procs(step) for step in self.setup]
        self._steps_procs = [_names_procs(step) for step in self.steps]

    def next_reply(self, state: AgentState, inputs: Sequence[Delivered] = ()) -> Reply:
        pos = state.cursor
        if pos >= self.total:
            actions: list[Any] = [{"op": "finish", "summary": "script complete"}]
        elif pos < len(self.setup):
            names = self._setup_procs[pos]
            actions = [_substitute(self.setup[pos], _last_procs(state) if names else {})]
        else:
            pos -= len(self.setup)
            step = self.steps[pos % len(self.steps)]
            values = {"{i}": str(pos // len(self.steps))}
            if self._steps_procs[pos % len(self.steps)]:  # (a scan of the recent results)
                values.update(_last_procs(state))
            actions = [_substitute(step, values)]
        return Reply(actions=actions, text=echo(inputs), usage=estimate_usage(state, actions))


class ReplayModel:
    name = "replay"

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies

    @classmethod
    def from_turns(cls, payloads: Iterable[Any]) -> ReplayModel:
        """Replies from the payloads of a recorded stream's `turn` events."""
        replies = []
        for p in payloads:
            if isinstance(p, dict):
                usage = p.get("usage") or {}
                replies.append(Reply(
                    actions=list(p.get("actions") or []), text=p.get("text"),
                    usage=Usage(int(usage.get("tokens_in", 0)), int(usage.get("tokens_out", 0)),
                                float(usage.get("cost_units", 0.0)))))
        return cls(replies)

    def next_reply(self, state: AgentState, inputs: Sequence[Delivered] = ()) -> Reply:
        if state.model_calls < len(self.replies):
            return self.replies[state.model_calls]
        actions: list[Any] = [{"op": "finish", "summary": "replay ended"}]
        return Reply(actions=actions, usage=estimate_usage(state, actions))


def make_backend(
    spec: AgentSpec, task: Task, read_turns: Callable[[str], Iterable[Any]], *,
    agent_dir: Path | None = None,
) -> Backend:
    """The backend a spec names; `read_turns(stream)` yields a stream's turn payloads;
    `agent_dir` holds the texts a model's context names (inputs, summaries)."""
    if spec.backend == "replay":
        if not spec.replay_stream:
            from broker.errors import ConfigError  # noqa: PLC0415

            raise ConfigError("backend replay needs replay_stream")
        return ReplayModel.from_turns(read_turns(spec.replay_stream))
    if spec.backend == "pipeline":
        from actors.pipelines.backend import PipelineModel  # noqa: PLC0415

        return PipelineModel.from_file(spec.task)
    if spec.backend == "openai":
        from actors.agent.openai_backend import OpenAIModel  # noqa: PLC0415

        return OpenAIModel(spec.settings.openai, task, spec.model, spec.settings.context_window,
                           agent_dir=agent_dir, compaction=spec.settings.compaction)
    return ScriptedModel(task)
