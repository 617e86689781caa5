"""The pipeline interpreter: (pipeline, inputs, track) to the next batch. Pure.

Outputs are never overwritten, so a restarted runner lands on its first
unsettled step. See docs/pipelines.md ("How a run runs").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from actors.kernel.pipeline_track import PipelineTrack
from actors.pipelines.dsl import TEMPLATE, ForStep, IfStep, OpStep, Pipeline

DEFAULT_BATCH = 16


class _BlockedError(Exception):
    """An instance needs an output that is not settled yet."""


class _FailedError(Exception):
    """The run cannot go on (loop items that are not a list)."""


@dataclass
class Batch:
    actions: list[dict[str, Any]] = field(default_factory=list)
    metas: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False  # nothing is left: the run is complete
    failure: str | None = None  # the run cannot go on, and why


@dataclass
class _Env:
    inputs: dict[str, str]
    track: PipelineTrack
    variables: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # output name -> its key here
    suffix: str = ""

    def child(self, var: str, item: Any, index: int) -> _Env:
        return _Env(self.inputs, self.track, {**self.variables, var: item, "index": index},
                    dict(self.keys), f"{self.suffix}#{index}")

    def lookup(self, ref: str) -> Any:
        if ref.startswith("inputs."):
            return self.inputs.get(ref.removeprefix("inputs."))
        if ref.startswith("outputs."):
            _, name, *path = ref.split(".")
            outcome = self.track.outputs.get(self.keys.get(name, name))
            if outcome is None:
                raise _BlockedError(ref)
            value: Any = outcome
            for part in path:
                if isinstance(value, dict):
                    value = value.get(part)
                elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                    value = value[int(part)]
                else:
                    value = None
            return value
        return self.variables.get(ref)

    def render(self, value: Any) -> Any:
        """Arguments with templates filled in: a template always makes a string."""
        if isinstance(value, str):
            return TEMPLATE.sub(lambda m: _text(self.lookup(m.group(1).strip())), value)
        if isinstance(value, list):
            return [self.render(v) for v in value]
        if isinstance(value, dict):
            return {k: self.render(v) for k, v in value.items()}
        return value

    def whole(self, value: Any) -> Any:
        """A value that is exactly one template keeps the referenced value's type."""
        if isinstance(value, str):
            match = TEMPLATE.fullmatch(value.strip())
            if match is not None:
                return self.lookup(match.group(1).strip())
        return self.render(value)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


@dataclass
class _Instance:
    step: OpStep
    env: _Env


def _walk(steps: list[Any], env: _Env) -> Iterator[_Instance]:
    for step in steps:
        if isinstance(step, OpStep):
            yield _Instance(step, env)
            if step.output is not None:
                env.keys[step.output] = step.output + env.suffix
        elif isinstance(step, ForStep):
            items = env.whole(step.for_.items)
            if isinstance(items, str):  # an input is a string: a JSON list there
                with contextlib.suppress(ValueError):
                    items = json.loads(items)
            if not isinstance(items, list):
                raise _FailedError(f"step {step.id}: loop items are {type(items).__name__}, "
                              "not a list")
            for i, item in enumerate(items[: step.for_.max]):
                yield from _walk(step.steps, env.child(step.for_.as_, item, i))
        elif isinstance(step, IfStep):
            yield from _walk(step.then if _holds(step, env) else step.else_, env)


def _holds(step: IfStep, env: _Env) -> bool:
    cond = step.if_
    outcome = env.lookup(f"outputs.{cond.output}")
    ok = cond.status is None or outcome.get("status") == cond.status
    if ok and cond.field is not None:
        ok = env.lookup(f"outputs.{cond.output}.result.{cond.field}") == cond.equals
    return ok != cond.negate


def next_batch(pipeline: Pipeline, inputs: dict[str, str], track: PipelineTrack | None,
               max_batch: int = DEFAULT_BATCH) -> Batch:
    track = track if track is not None else PipelineTrack()
    batch = Batch()
    env = _Env(inputs, track)
    position = 0
    try:
        for instance in _walk(pipeline.steps, env):
            if position >= track.done:
                step, here = instance.step, instance.env
                args = dict(step.args)
                if step.timeout_s is not None:
                    args["timeout_s"] = step.timeout_s
                action = {"op": step.op, **here.render(args)}
                if "timeout_s" in action and step.timeout_s is not None:
                    action["timeout_s"] = step.timeout_s  # a number, not a rendered string
                key = step.output + here.suffix if step.output is not None else None
                batch.actions.append(action)
                batch.metas.append({"id": step.id + here.suffix, "output": key,
                                    "stop": step.on_error == "stop"})
                if len(batch.actions) >= max_batch:
                    return batch
            position += 1
    except _BlockedError:
        return batch
    except _FailedError as exc:
        if not batch.actions:
            batch.failure = str(exc)
        return batch
    batch.finished = not batch.actions
    return batch


def outputs_of(pipeline: Pipeline, inputs: dict[str, str],
               track: PipelineTrack | None) -> dict[str, Any]:
    """The pipeline's declared outputs from a run's settled results."""
    env = _Env(inputs, track if track is not None else PipelineTrack())
    for name in _top_outputs(pipeline.steps):
        env.keys[name] = name
    out: dict[str, Any] = {}
    for name, value in pipeline.outputs.items():
        try:
            out[name] = env.whole(value)
        except _BlockedError:
            out[name] = None
    return out


def _top_outputs(steps: list[Any]) -> list[str]:
    return [s.output for s in steps if isinstance(s, OpStep) and s.output is not None]
