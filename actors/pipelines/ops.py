"""The agent op `pipeline_run`: an installed pipeline run in the agent's process.

`replay_safe` (the runner is keyed by the call); runs never nest.
See docs/pipelines.md ("`pipeline_run` (the agent op)").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from actors.kernel.ops import Done, OpBase, OpContext, OpSpec, Outcome
from actors.kernel.settings import AgentSettings, AgentSpec, read_spec
from actors.pipelines import report, runfile
from actors.registries import schemas, store
from broker.errors import ConfigError, StateDirError
from broker.statedir import check_actor_name

InputValue = Annotated[str, Field(max_length=65536)]


class PipelineRun(OpBase):
    """Run an installed pipeline with the given inputs; returns its outputs."""

    op: Literal["pipeline_run"] = "pipeline_run"
    name: schemas.EntryName
    inputs: dict[str, InputValue] = Field(default_factory=dict)
    wait_s: Annotated[float, Field(gt=0, le=3600)] = 600.0
    replay_safe: ClassVar[bool] = True

    def deadline_s(self, ctx: OpContext) -> float:
        return self.wait_s + 30.0  # the wait, plus the appends of the last step


@dataclass
class _AsRunner:
    """The agent's writer client appending as its runner (its own origin, so
    the runner's idempotency keys are its own)."""

    writer: Any
    origin: str

    def append(self, stream: str, event: str, payload: Any, *, key: str,
               ledger: Any = None) -> Any:
        return self.writer.append(stream, event, payload, key=key, ledger=ledger,
                                  origin=self.origin)

    def append_many(self, stream: str, records: list[Any]) -> Any:
        return self.writer.append_many(stream, records, origin=self.origin)

    def __getattr__(self, name: str) -> Any:  # reads, timeouts: the agent's client
        return getattr(self.writer, name)


def runner_name(agent: str, call_id: str) -> str:
    """`<agent>.pl-<call>`; a call id on a rewound branch (`r<seq>:4.0`) is
    spelled `r<seq>-4.0` (an actor name has no colon)."""
    return check_actor_name(f"{agent}.pl-{call_id.replace(':', '-')}")


def pipeline_run(op: PipelineRun, ctx: OpContext) -> Outcome:
    if ctx.writer is None or ctx.call_id is None or ctx.nested is None:
        return Done({"error": "pipeline_run needs the agent's writer and loop"}, ok=False)
    try:
        name = runner_name(ctx.agent, ctx.call_id)
        entry = store.newest(ctx.state_dir, "pipelines").get(op.name)
        if entry is None:
            return Done({"error": f"no installed pipeline {op.name!r}"}, ok=False)
        run = runfile.RunFile(pipeline=op.name, source=f"registry:{op.name}",
                              text=str(entry["text"]), inputs=op.inputs)
        runfile.check_inputs(run.parsed(), op.inputs)
        path = runfile.path_for(ctx.state_dir, name)
        if path.exists():  # the call run again after a crash: the same run goes on
            run = runfile.read(path)
        else:
            runfile.write(ctx.state_dir, name, run)
        parent = read_spec(ctx.state_dir, ctx.agent)
    except (ConfigError, StateDirError, store.RegistryError) as exc:
        return Done({"error": str(exc)[:2000]}, ok=False)
    settings = runfile.runner_settings(parent.settings if parent else AgentSettings())
    spec = AgentSpec(task=str(path), backend="pipeline", workspace=str(ctx.workspace),
                     settings=settings)
    state = ctx.nested(name, spec, _AsRunner(ctx.writer, name), op.wait_s)
    if state is None:
        return Done({"runner": name, "error": f"still waiting after {op.wait_s:g}s "
                     f"(supervisor approve {name} ...)", "timeout": True},
                    ok=False, status="timeout")
    result = report.summarise(run, state)
    return Done({"runner": name, **result}, ok=result["status"] == "ok")


OPS = (OpSpec(PipelineRun, pipeline_run),)
