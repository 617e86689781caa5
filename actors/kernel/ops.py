"""Typed ops: the registry that makes them one pydantic discriminated union.

The one place ops join; an op's class variables tell the gate and the loop
what it touches. See docs/agents.md ("Ops").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from broker.statedir import StateDir

if TYPE_CHECKING:
    from actors.kernel.settings import AgentSpec
    from actors.kernel.state import AgentState
    from actors.kernel.workspace import Place


class OpBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    op: str
    path_field: ClassVar[str | None] = None
    command_field: ClassVar[str | None] = None
    mutates: ClassVar[bool] = False
    needs_operator: ClassVar[bool] = False
    ends_session: ClassVar[bool] = False
    replay_safe: ClassVar[bool] = False
    secret_fields: ClassVar[tuple[str, ...]] = ()
    call_deadline_s: ClassVar[float] = 0.0

    def deadline_s(self, ctx: OpContext) -> float:
        """The longest this call may take before it ends with a timeout."""
        return self.call_deadline_s

    def gate_path(self) -> str | None:
        value = getattr(self, self.path_field) if self.path_field else None
        return value if isinstance(value, str) else None

    def gate_command(self) -> str | None:
        value = getattr(self, self.command_field) if self.command_field else None
        return value if isinstance(value, str) else None

    def gate_op(self) -> str:
        """The name permission rules match: the op's, or a finer one (an MCP
        call is `mcp:<server>/<tool>`, actors/agent/mcp_ops.py)."""
        return self.op

    @classmethod
    def replay_safe_for(cls, action: Any, state_dir: StateDir, agent: str) -> bool:
        """Whether this raw action is replay-safe when the op as a whole is not
        (an MCP tool the server annotated idempotent or read-only)."""
        return False


class NestedRun(Protocol):
    """How an op runs a nested runner in its agent's own process (a pipeline
    run, actors/pipelines/ops.py): the loop passes one in the op's context, so
    an op never imports the loop that calls it (actors/agent/loop.py)."""

    def __call__(self, name: str, spec: AgentSpec, writer: Any, wait_s: float
                 ) -> AgentState | None:
        """Run the runner `name` under `spec`, appending with `writer`, until
        its session ends (its state), or None once it has waited for the
        operator past `wait_s` (it stays where it is)."""
        ...


@dataclass(frozen=True)
class OpContext:
    """What a handler may use: its agent's workspace and memory, and limits."""

    agent: str
    workspace: Path
    memory_dir: Path
    state_dir: StateDir
    max_result_chars: int = 8192
    answer: dict[str, Any] | None = None  # the operator's answer, for needs_operator ops
    peer: Any = None  # the agent's BrokerPeer: ops served by procs and subagents use it
    call_id: str | None = None  # the call being run: stable across a crash and redo
    # whether the permission rules let this op show a workspace-relative path
    # (search results, directory entries); None shows everything
    path_visible: Callable[[str], bool] | None = None
    max_command_timeout_s: float = 600.0  # a command's timeout is clipped to this
    writer: Any = None  # the agent's WriterClient: registry ops record their generation
    nested: NestedRun | None = None  # the loop's nested runner (pipeline_run)


@dataclass(frozen=True)
class Done:
    result: dict[str, Any]
    ok: bool = True
    facts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # extra events
    status: str | None = None  # the tool_result status when not ok/error (e.g. "timeout")


@dataclass(frozen=True)
class Write:
    """Replace `target` with `content` (None: delete); `label` names it in events."""

    target: Place
    label: str
    content: bytes | None
    result: dict[str, Any]


Outcome = Done | Write
Handler = Callable[[Any, OpContext], Outcome]


@dataclass(frozen=True)
class Rejected:
    """A malformed action: which op it claimed and value-free field errors."""

    op: str | None
    errors: list[str]


@dataclass(frozen=True)
class OpSpec:
    """One op: its model and handler; `local` as in `register`."""

    model: type[OpBase]
    handler: Handler
    local: bool = False


_MODELS: dict[str, type[OpBase]] = {}
_HANDLERS: dict[str, Handler] = {}
_LOCAL: set[str] = set()
_adapter: TypeAdapter[Any] | None = None


def register(model: type[OpBase], handler: Handler, *, local: bool = False) -> None:
    """Add an op to the union (idempotent for the same model). `local`: its
    handler has no effect outside the agent's process (it reads, or returns a
    `Write` that the loop applies), so the loop need not make the call's
    facts durable before calling it."""
    global _adapter  # noqa: PLW0603 - the registry is module state by design
    name = model.model_fields["op"].default
    if not isinstance(name, str):
        raise TypeError(f"{model.__name__}.op needs a Literal default")
    existing = _MODELS.get(name)
    if existing is not None and existing is not model:
        raise ValueError(f"op {name!r} is already registered by {existing.__name__}")
    if existing is model and _HANDLERS[name] is handler and (name in _LOCAL) == local:
        return  # installed already: the union stays built
    _MODELS[name] = model
    _HANDLERS[name] = handler
    if local:
        _LOCAL.add(name)
    else:
        _LOCAL.discard(name)
    _adapter = None


def install(specs: Iterable[OpSpec]) -> None:
    """Register every spec (installing the same specs again changes nothing)."""
    for spec in specs:
        register(spec.model, spec.handler, local=spec.local)


def op_names() -> list[str]:
    """Registered op names, in registration order (heartbeat codes index this)."""
    return list(_MODELS)


def model_for(name: str) -> type[OpBase] | None:
    return _MODELS.get(name)


def is_local(name: str) -> bool:
    """The op's handler touches nothing outside the agent (see `register`)."""
    return name in _LOCAL


def handler_for(name: str) -> Handler:
    return _HANDLERS[name]


def _union() -> TypeAdapter[Any]:
    global _adapter  # noqa: PLW0603
    if _adapter is None:
        models = tuple(_MODELS.values())
        member: Any = models[0] if len(models) == 1 else Union[models]  # noqa: UP007
        _adapter = TypeAdapter(Annotated[member, Field(discriminator="op")])
    return _adapter


def warm() -> None:
    """Build the union's validator now (cheap to call again)."""
    _union()


def parse_action(action: object) -> OpBase | Rejected:
    """Validate one model action; never raises. Errors carry no argument values."""
    if not isinstance(action, dict):
        return Rejected(None, [f"action is a {type(action).__name__}, not an object"])
    name = action.get("op")
    if not isinstance(name, str) or name not in _MODELS:
        return Rejected(name if isinstance(name, str) else None, [f"unknown op {name!r}"[:100]])
    try:
        parsed = _union().validate_python(action)
    except ValidationError as exc:
        errors = [
            f"{'.'.join(str(p) for p in err['loc'][1:]) or '(action)'}: {err['type']}"
            for err in exc.errors(include_input=False)
        ]
        return Rejected(name, errors[:10])
    assert isinstance(parsed, OpBase)
    return parsed


def tool_schemas() -> list[dict[str, Any]]:
    """OpenAI-style function declarations for every registered op."""
    out = []
    for name, model in _MODELS.items():
        schema = model.model_json_schema()
        props = {k: v for k, v in schema.get("properties", {}).items() if k != "op"}
        required = [r for r in schema.get("required", []) if r != "op"]
        out.append({
            "type": "function",
            "function": {
                "name": name,
                "description": (model.__doc__ or name).strip().splitlines()[0],
                "parameters": {"type": "object", "properties": props, "required": required},
            },
        })
    return out
