"""An agent's settings (the `agent:` section) and its spec file.

An agent without a spec file is an idle agent. See docs/agents.md
("Specs and process").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.errors import ConfigError
from broker.statedir import StateDir

# the C loader when libyaml is there (~10x faster; a child agent loads its task at start)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Decision = Literal["allow", "ask", "deny"]
BackendName = Literal["scripted", "replay", "openai", "pipeline"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rule(_Strict):
    """One permission rule; the first rule that matches an op decides.

    `op` is an op name or "*"; `path` a glob (fnmatch: `*` also crosses "/")
    matched on the workspace-relative path; `command` a prefix matched on an
    op's command argument (ops that run commands). A rule with `path` or
    `command` matches only ops that carry that argument."""

    op: str = "*"
    path: str | None = None
    command: str | None = None
    decision: Decision


class Permissions(_Strict):
    default: Decision = "allow"
    rules: list[Rule] = Field(default_factory=list)


class Budget(_Strict):
    """Bounds on model use; None is unbounded."""

    tokens: Annotated[int, Field(ge=0)] | None = None
    cost_units: Annotated[float, Field(ge=0)] | None = None


class OpenAISettings(_Strict):
    """An OpenAI-compatible /v1/chat/completions endpoint. The key is read from
    the environment variable named by `api_key_env` (never from this file)."""

    base_url: str = "http://127.0.0.1:11434/v1"
    model: str = "llama3.1"
    api_key_env: str = "OPENAI_API_KEY"
    # one model call may take timeout_s * (max_retries + 1) + the backoffs: 181.5 s
    # by default, within agent.max_model_call_s (docs/agents.md, "Long calls")
    timeout_s: Annotated[float, Field(gt=0)] = 60.0
    max_retries: Annotated[int, Field(ge=0)] = 2
    backoff_base_s: Annotated[float, Field(ge=0)] = 0.5
    backoff_cap_s: Annotated[float, Field(ge=0)] = 8.0
    temperature: float = 0.0

    def call_deadline_s(self) -> float:
        """The longest one model call may take: every attempt's timeout plus
        every backoff between them (a Retry-After is honoured up to the cap too)."""
        backoffs = sum(min(self.backoff_cap_s, self.backoff_base_s * 2.0 ** n)
                       for n in range(self.max_retries))
        return float(self.timeout_s * (self.max_retries + 1) + backoffs)


class CompactionSettings(_Strict):
    """Context compaction (actors/kernel/compaction.py): off while `window_tokens`
    is null. When the model's context passes `trigger_share` of the window, the
    oldest exchanges are replaced by a summary so that those kept fill at most
    `keep_share` of it. `summary_model`: the model that summarizes (openai; null:
    the agent's own)."""

    window_tokens: Annotated[int, Field(ge=1024)] | None = None
    trigger_share: Annotated[float, Field(gt=0, le=1)] = 0.75
    keep_share: Annotated[float, Field(gt=0, lt=1)] = 0.3
    summary_chars: Annotated[int, Field(ge=200, le=100_000)] = 4000
    summary_model: str | None = None

    @model_validator(mode="after")
    def _fits(self) -> CompactionSettings:
        if self.window_tokens is not None and (
                self.keep_share >= self.trigger_share
                or 200 + self.summary_chars // 4 >= self.window_tokens * (
                    self.trigger_share - self.keep_share)):
            raise ValueError("compaction: keep_share must be below trigger_share, and a "
                             "summary (summary_chars / 4 tokens) must fit between them")
        return self


class AgentSettings(_Strict):
    """The `agent:` section of the runtime configuration."""

    max_turns: Annotated[int, Field(ge=1)] = 500
    budget: Budget = Budget()
    exclude: list[str] = Field(default_factory=list)
    permissions: Permissions = Permissions()
    snapshot_every: Annotated[int, Field(ge=1)] = 256
    # the workspace capture at each turn boundary reads only what inotify reports
    # changed, with a full walk at least every second (docs/trees.md, "Watched
    # captures"); false: a full walk at every boundary
    watch_workspace: bool = True
    generations_kept: Annotated[int, Field(ge=1)] = 3
    context_window: Annotated[int, Field(ge=1)] = 20
    max_result_chars: Annotated[int, Field(ge=256)] = 8192
    approval_poll_ms: Annotated[int, Field(ge=5)] = 100
    # a command op's timeout (the model's, default 120 s) is clipped to this
    max_command_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 600.0
    # the longest one model call may take, all retries included (checked against openai)
    max_model_call_s: Annotated[float, Field(gt=0)] = 300.0
    openai: OpenAISettings = OpenAISettings()
    compaction: CompactionSettings = CompactionSettings()


class AgentSpec(_Strict):
    """One agent's assignment, as `supervisor run` / `spawn` write it."""

    task: str  # path of the task file
    backend: BackendName = "scripted"
    model: str | None = None  # openai: overrides settings.openai.model
    replay_stream: str | None = None  # replay: the stream whose replies are played
    workspace: str | None = None  # None: .corral/agents/<name>/workspace/
    settings: AgentSettings = AgentSettings()
    session: str | None = None  # the session to run (actors/sessions/lifecycle.py)
    parent_agent: str | None = None  # a subagent's parent (the session's lineage)
    # the agent whose grants and budget bound this one (a schedule's run: the
    # schedule's owner; actors/procs/grants.py); None: the operator created it
    creator: str | None = None


class Task(_Strict):
    name: str = "task"
    prompt: str = ""
    repeat: Annotated[int, Field(ge=1)] = 1
    setup: list[Any] = Field(default_factory=list)  # played once, before the loop
    steps: list[Any] = Field(default_factory=list)  # raw actions: validated by the loop


def parse_model(text: str | None) -> dict[str, Any]:
    """The model of `supervisor spawn --model`: scripted | replay:STREAM | openai |
    openai:MODEL, as `AgentSpec` fields."""
    if not text or text == "scripted":
        return {"backend": "scripted"}
    kind, _, rest = text.partition(":")
    if kind == "replay" and rest:
        return {"backend": "replay", "replay_stream": rest}
    if kind == "openai":
        return {"backend": "openai", "model": rest or None}
    raise ValueError(f"unknown model {text!r}: use scripted, replay:STREAM, openai[:MODEL]")


def spec_path(state_dir: StateDir, name: str) -> Path:
    return state_dir.config_dir / "agents" / f"{name}.json"


def write_spec(state_dir: StateDir, name: str, spec: AgentSpec) -> Path:
    """Write an agent's spec atomically (temp, fsync, rename)."""
    path = spec_path(state_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(spec.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def read_spec(state_dir: StateDir, name: str) -> AgentSpec | None:
    """The agent's spec, or None when it has none (an idle agent)."""
    path = spec_path(state_dir, name)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        return AgentSpec.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"{path}: invalid agent spec: {exc}") from exc


def load_task(path: str | Path) -> Task:
    path = Path(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_SafeLoader)  # noqa: S506
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read task: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: invalid task: expected a mapping at the top level")
    try:
        return Task.model_validate(data or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        if first["type"] == "extra_forbidden":
            known = ", ".join(Task.model_fields)
            reason = f"unknown key {where!r} (a task has: {known})"
        else:
            reason = f"{where}: {first['msg']}"
        raise ConfigError(f"{path}: invalid task: {reason}") from exc


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: where, and what (its own text spans several)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def workspace_for(state_dir: StateDir, name: str, spec: AgentSpec) -> Path:
    """The agent's workspace: the spec's directory, or .corral/agents/<name>/workspace/."""
    if spec.workspace is not None:
        return Path(spec.workspace).resolve()
    return state_dir.agent_dir(name) / "workspace"
