"""A pipeline run's file, `.corral/pipelines/<runner>.json`: what its runner is told.

Written once, durably, before the spawn. See docs/pipelines.md ("How a run
runs").
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.kernel.settings import AgentSettings, CompactionSettings
from actors.pipelines import dsl
from broker.errors import ConfigError
from broker.statedir import StateDir

VERSION = 1
MAX_TEXT = 1 << 20
MAX_INPUTS = 1024
InputValue = Annotated[str, Field(max_length=65536)]


class RunFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = VERSION
    pipeline: str  # its name
    source: str  # the file or `registry:<name>@<seq>` it came from
    text: Annotated[str, Field(max_length=MAX_TEXT)]
    inputs: Annotated[dict[str, InputValue], Field(max_length=MAX_INPUTS)] = Field(
        default_factory=dict)

    def parsed(self) -> dsl.Pipeline:
        return dsl.parse(self.text, self.source)

    def digest(self) -> str:
        """sha256 of what the run was told (text, source, inputs): the runner
        records it with its first batch and goes on only while the file
        still matches (actors/pipelines/backend.py)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def build(*, pipeline: str, source: str, text: str, inputs: dict[str, str]) -> RunFile:
    """A run file, or a ConfigError that names the key and the bound it broke."""
    try:
        return RunFile(pipeline=pipeline, source=source, text=text, inputs=inputs)
    except ValidationError as exc:
        raise ConfigError(f"invalid pipeline run: {_first_error(exc)}") from exc


def check_inputs(pipeline: dsl.Pipeline, inputs: dict[str, str]) -> None:
    """Every declared input given, no other."""
    unknown = sorted(set(inputs) - set(pipeline.inputs))
    if unknown:
        raise ConfigError(f"pipeline {pipeline.name} has no input {unknown[0]!r} "
                          f"(inputs: {', '.join(pipeline.inputs) or 'none'})")
    missing = [name for name in pipeline.inputs if name not in inputs]
    if missing:
        raise ConfigError(f"pipeline {pipeline.name} needs input {missing[0]!r} (--input k=v)")


def path_for(state_dir: StateDir, runner: str) -> Path:
    return state_dir.root / "pipelines" / f"{runner}.json"


def write(state_dir: StateDir, runner: str, run: RunFile) -> Path:
    path = path_for(state_dir, runner)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(run.model_dump_json())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read(path: str | Path) -> RunFile:
    path = Path(path)
    try:
        return RunFile.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the pipeline run: {exc.strerror}") from exc
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid pipeline run: {_first_error(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid pipeline run: {exc}") from exc


def _first_error(exc: ValidationError) -> str:
    """The first error with its key and the bound it broke (not pydantic's
    "1 validation error for RunFile")."""
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) or "(top level)"
    more = len(exc.errors()) - 1
    return f"{where}: {err['msg']}" + (f" (and {more} more)" if more else "")


def runner_settings(settings: AgentSettings) -> AgentSettings:
    """A runner's agent settings: the configuration's gate (rules, exclusions,
    budget) as they are, a turn bound that a bounded pipeline cannot reach
    (one turn per batch, at most one per step instance), `pipeline_run`
    excluded (no nested launch, whatever the file says), compaction off."""
    exclude = list(settings.exclude)
    if "pipeline_run" not in exclude:
        exclude.append("pipeline_run")
    # no context compaction: a pipeline has no model context to keep small
    return settings.model_copy(update={"max_turns": dsl.MAX_INSTANCES + 2, "exclude": exclude,
                                       "compaction": CompactionSettings()})
