"""The supervisor's configuration: a strict pydantic model of config/default.yaml.

`load()` raises ConfigError naming the file, the dotted key and what was
expected. See docs/supervisor.md and docs/operations.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from actors.kernel.settings import AgentSettings, yaml_problem
from broker.errors import ConfigError
from supervisor.automationconfig import AutomationConfig
from supervisor.fleetconfig import FleetConfig
from supervisor.runconfig import RunSettings
from supervisor.runtime.policy import Policy
from supervisor.storage import StorageConfig


def _defaults_dir() -> Path:
    """The default configuration and demo tasks: the repository's config/, installed
    as the package data `supervisor.defaults` (a plain checkout: config/ itself)."""
    spec = importlib.util.find_spec("supervisor.defaults")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "default.yaml").is_file():
            return Path(location).resolve()
    return Path(__file__).resolve().parent.parent / "config"


DEFAULTS_DIR = _defaults_dir()
DEFAULT_CONFIG_PATH = DEFAULTS_DIR / "default.yaml"

ChildKind = Literal["writer", "broker", "procs", "subagents", "agent"]
# Start order; stop runs it backwards.
KIND_ORDER: tuple[ChildKind, ...] = ("writer", "broker", "procs", "subagents", "agent")
CORE_KINDS: frozenset[str] = frozenset({"writer", "broker"})
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
PositiveS = Annotated[float, Field(gt=0)]



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Intensity(_Strict):
    max_restarts: Annotated[int, Field(ge=0)] = 5
    period_s: PositiveS = 60.0


class Backoff(_Strict):
    base_s: Annotated[float, Field(ge=0)] = 0.5
    cap_s: Annotated[float, Field(ge=0)] = 30.0
    jitter: Annotated[float, Field(ge=0, le=1)] = 0.1


class ChildPolicy(_Strict):
    """What every child spec and the agents template share."""

    restart: Literal["permanent", "transient", "temporary"] = "permanent"
    intensity: Intensity = Intensity()
    backoff: Backoff = Backoff()
    shutdown_timeout_s: PositiveS = 5.0
    ready_timeout_s: PositiveS | None = 10.0  # None: the child never sends `ready`
    fatal_exit_codes: list[int] = Field(default_factory=list)

    def policy(self) -> Policy:
        return Policy(
            restart=self.restart,
            max_restarts=self.intensity.max_restarts,
            period_s=self.intensity.period_s,
            base_s=self.backoff.base_s,
            cap_s=self.backoff.cap_s,
            jitter=self.backoff.jitter,
            fatal_exit_codes=frozenset(self.fatal_exit_codes),
        )


class ChildSpec(ChildPolicy):
    name: Name
    kind: ChildKind
    enabled: bool = True
    # argv replacing the kind's default; "{python}" and "{state_dir}" are expanded.
    command: list[str] | None = None


class AgentsGroup(ChildPolicy):
    """`count` idle agent processes named <name_prefix><i>, forked by the zygote."""

    count: Annotated[int, Field(ge=0, le=10_000)] = 0
    name_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,55}$")] = "agent-"
    zygote: bool = True  # False: each agent is a fresh interpreter (slow, for baselines)
    # agents the zygote keeps forked ahead of requests (actors/zygote.py, "The pool");
    # None: as many as the supervisor starts at once (the cores, at least 2); 0: none
    zygote_pool: Annotated[int, Field(ge=0, le=64)] | None = None

    def child_template(self) -> dict[str, Any]:
        """The policy each agent of the group gets (its ChildSpec's fields):
        everything but what concerns the group as a whole."""
        return self.model_dump(exclude={"count", "name_prefix", "zygote", "zygote_pool"})


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    max_bytes: Annotated[int, Field(ge=4096)] = 16 * 1024 * 1024
    backups: Annotated[int, Field(ge=0, le=100)] = 5


# A child must be able to miss this many beats in a row before it counts as silent.
MIN_BEATS_PER_TIMEOUT = 3


class HeartbeatConfig(_Strict):
    interval_ms: Annotated[int, Field(ge=10)] = 1000  # agents' heartbeat period
    timeout_s: PositiveS = 10.0  # a child silent this long after a first beat is killed

    @model_validator(mode="after")
    def _check_timeout(self) -> HeartbeatConfig:
        least_s = MIN_BEATS_PER_TIMEOUT * self.interval_ms / 1000
        if self.timeout_s < least_s:
            raise ValueError(
                f"timeout_s {self.timeout_s:g} is shorter than {MIN_BEATS_PER_TIMEOUT} "
                f"heartbeats of interval_ms {self.interval_ms}: a healthy child would be "
                f"killed between beats; make it at least {least_s:g}")
        return self


class WriterOptions(_Strict):
    log_level: Literal["debug", "info", "warning", "error"] | None = None


class BrokerOptions(_Strict):
    heartbeat_interval_ms: Annotated[int, Field(ge=10)] | None = None
    heartbeat_misses: Annotated[int, Field(ge=1)] | None = None


class MetricsConfig(_Strict):
    # host:port of the Prometheus endpoint (loopback only; port 0: any free port,
    # written to run/metrics.port); null: no endpoint (supervisor/runtime/metrics.py)
    listen: str | None = None

    @model_validator(mode="after")
    def _loopback(self) -> MetricsConfig:
        if self.listen is not None:
            from supervisor.runtime.metrics import parse_listen  # noqa: PLC0415 - only when set

            parse_listen(self.listen)
        return self


class ConsoleConfig(_Strict):
    # `supervisor console --listen` may name a non-loopback address only when this
    # says so (docs/console.md); the console is off unless that command runs
    allow_remote: bool = False


class SandboxLimits(_Strict):
    """What one job may use (actors/procs/cgroup.py; 0: no limit)."""

    processes: Annotated[int, Field(ge=0)] = 256
    memory_bytes: Annotated[int, Field(ge=0)] = 1024 * 1024 * 1024
    cpu_weight: Annotated[int, Field(ge=1, le=10000)] = 100
    workspace_bytes: Annotated[int, Field(ge=0)] = 1024 * 1024 * 1024


class SandboxConfig(_Strict):
    """procs' command sandbox (actors/procs/sandbox.py, docs/security.md).
    YAML reads `on`/`off` as booleans: both spellings are taken."""

    mode: Literal["on", "off"] | bool = "on"
    network: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list)  # sessions (fnmatch) whose commands get the network
    hide: list[Annotated[str, Field(pattern=r"^/.+")]] = Field(
        default_factory=lambda: ["/run"])  # host paths hidden besides the state directory
    cgroups: Literal["on", "off"] | bool = "on"  # off: jobs may run without a control group
    tmp_bytes: Annotated[int, Field(ge=0)] = 256 * 1024 * 1024  # the sandbox's /tmp (0: unsized)
    limits: SandboxLimits = SandboxLimits()  # per job, in its control group

    @property
    def enabled(self) -> bool:
        return self.mode in ("on", True)

    def procs_args(self, secrets: Sequence[str] = ()) -> list[str]:
        """procs' command-line options for this policy; `secrets` (files the
        runtime holds: the fleet's credentials) are hidden besides `hide`."""
        args = ["--sandbox", "on" if self.enabled else "off"]
        for pattern in self.network:
            args += ["--sandbox-network", pattern]
        for path in dict.fromkeys([*self.hide, *secrets]):
            args += ["--sandbox-hide", path]
        args += ["--cgroups", "on" if self.cgroups in ("on", True) else "off",
                 "--tmp-bytes", str(self.tmp_bytes),
                 "--limit-processes", str(self.limits.processes),
                 "--limit-memory-bytes", str(self.limits.memory_bytes),
                 "--limit-cpu-weight", str(self.limits.cpu_weight),
                 "--limit-workspace-bytes", str(self.limits.workspace_bytes)]
        return args


class Config(_Strict):
    logging: LoggingConfig = LoggingConfig()
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    status_interval_s: PositiveS = 1.0
    writer: WriterOptions = WriterOptions()
    broker: BrokerOptions = BrokerOptions()
    children: list[ChildSpec] = Field(default_factory=list)
    agents: AgentsGroup = AgentsGroup()
    agent: AgentSettings = AgentSettings()  # the agent loop: bounds, gate rules, backends
    run: RunSettings = RunSettings()  # `supervisor run`
    metrics: MetricsConfig = MetricsConfig()
    console: ConsoleConfig = ConsoleConfig()  # `supervisor console` (docs/console.md)
    sandbox: SandboxConfig = SandboxConfig()  # procs' command sandbox
    storage: StorageConfig = StorageConfig()  # caps and collection (docs/storage.md)
    fleet: FleetConfig = FleetConfig()  # a fleet of hosts on NATS JetStream (docs/fleet.md)
    automation: AutomationConfig = AutomationConfig()  # schedules and hooks

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_switch(cls, value: object) -> object:
        """`sandbox: off` (or `on`) alone is the mode."""
        return {"mode": value} if isinstance(value, bool | str) else value

    @model_validator(mode="after")
    def _check_calls(self) -> Config:
        """A model call's own deadline must fit its configured bound (docs/agents.md)."""
        openai, bound = self.agent.openai, self.agent.max_model_call_s
        deadline = openai.call_deadline_s()
        if deadline > bound:
            raise ValueError(
                f"agent.openai: timeout_s {openai.timeout_s:g} x (max_retries "
                f"{openai.max_retries} + 1) + backoffs = {deadline:g}s, longer than "
                f"agent.max_model_call_s {bound:g}: lower the timeout or the retries, "
                f"or raise the bound")
        return self

    @model_validator(mode="after")
    def _check_children(self) -> Config:
        names = [c.name for c in self.children]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate child names {dupes}")
        for kind in ("writer", "broker"):
            count = sum(1 for c in self.children if c.kind == kind and c.enabled)
            if count != 1:
                raise ValueError(f"exactly one enabled {kind} child is needed, found {count}")
        return self

    def child_specs(self) -> list[ChildSpec]:
        """Enabled children in start order, the agents group expanded."""
        group = self.agents
        template = group.child_template()
        agents = [
            ChildSpec(name=f"{group.name_prefix}{i}", kind="agent", **template)
            for i in range(1, group.count + 1)
        ]
        specs = [c for c in self.children if c.enabled] + agents
        taken = [s.name for s in specs]
        if len(set(taken)) != len(taken):
            raise ConfigError("agents: generated agent names collide with a child name")
        return sorted(specs, key=lambda s: KIND_ORDER.index(s.kind))


def _describe(error: dict[str, object]) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "__root__") or "(top level)"  # type: ignore[attr-defined]
    msg = str(error.get("msg", "invalid"))
    if error.get("type") == "extra_forbidden":
        return f"{loc}: unknown key"
    if msg.startswith("Value error, "):
        return f"{loc}: {msg.removeprefix('Value error, ')}"
    expected = msg.removeprefix("Input should be ")
    got = error.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"{loc}: expected {expected}{shown}"


def parse(data: object, source: str) -> Config:
    """Validate already-loaded YAML data; ConfigError names the source."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{source}: {_describe(dict(first))}{more}") from exc


def load(path: Path | None) -> Config:
    """Read and validate a configuration file (the default one when None)."""
    path = path or DEFAULT_CONFIG_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
    return parse(data, str(path))
