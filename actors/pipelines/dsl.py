"""The pipeline file: its models, strict loading, and the checks that close it.

Any refusal is a `PipelineError` naming the file, the line and the key.
See docs/pipelines.md ("The file").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)

from actors.kernel import ops
from actors.pipelines import yamlmarks
from broker.errors import ConfigError

MAX_INSTANCES = 100_000  # the most step instances one pipeline may expand to
MAX_FOR = 10_000
REFUSED_OPS = {
    "pipeline_run": "a pipeline cannot launch a pipeline (no nested launch, no recursion)",
    "finish": "the runner ends the pipeline itself",
}
Name = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
StepId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")]
TEMPLATE = re.compile(r"\$\{([^{}]*)\}")
REF = re.compile(r"^(inputs\.[A-Za-z_]\w*|outputs\.[A-Za-z_]\w*(\.[A-Za-z0-9_]+)*|"
                 r"[A-Za-z_]\w*)$")


class PipelineError(ConfigError):
    """A pipeline file refused before it runs: `file:line: key: message`."""

    def __init__(self, source: str, line: int, key: str, message: str) -> None:
        super().__init__(f"{source}:{line}: {key}: {message}")
        self.source, self.line, self.key, self.message = source, line, key, message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class OpStep(_Strict):
    id: StepId
    op: Annotated[str, Field(min_length=1, max_length=64)]
    args: dict[str, Any] = Field(default_factory=dict)
    output: Name | None = None
    on_error: Literal["stop", "continue"] = "stop"
    timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None


class Loop(_Strict):
    items: list[Any] | str
    as_: Name = Field(alias="as")
    max: Annotated[int, Field(ge=1, le=MAX_FOR)]


class ForStep(_Strict):
    id: StepId
    for_: Loop = Field(alias="for")
    steps: Annotated[list[Step], Field(min_length=1)]


class Condition(_Strict):
    output: Name
    status: str | None = "ok"  # the step's status (ok, error, denied, ...); null: any
    field: Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")] | None = None
    equals: Any = None  # with `field`: the result's value there must equal this
    negate: bool = False


class IfStep(_Strict):
    id: StepId
    if_: Condition = Field(alias="if")
    then: list[Step] = Field(default_factory=list)
    else_: list[Step] = Field(default_factory=list, alias="else")


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        if "for" in value:
            return "for-step"
        if "if" in value:
            return "if-step"
    return "op-step"


Step = Annotated[
    Annotated[OpStep, Tag("op-step")] | Annotated[ForStep, Tag("for-step")]
    | Annotated[IfStep, Tag("if-step")],
    Discriminator(_kind),
]


class Pipeline(_Strict):
    name: StepId
    description: str = ""
    inputs: list[Name] = Field(default_factory=list)
    steps: Annotated[list[Step], Field(min_length=1)]
    outputs: dict[Name, Any] = Field(default_factory=dict)


ForStep.model_rebuild()
IfStep.model_rebuild()
Pipeline.model_rebuild()


def load(path: Path) -> Pipeline:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PipelineError(str(path), 1, "(file)", f"cannot read: {exc.strerror}") from exc
    return parse(text, str(path))


def parse(text: str, source: str) -> Pipeline:
    """The pipeline in `text`, checked; `source` names it in errors."""
    try:
        data, lines = yamlmarks.load(text)
    except yamlmarks.YamlRefusalError as exc:
        raise PipelineError(source, exc.line, exc.key, exc.message) from exc
    try:
        pipeline = Pipeline.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()  # an unknown key (`while:`) says more than what it lacks
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        line, key = yamlmarks.locate(data, lines, tuple(err["loc"]))
        raise PipelineError(source, line, key, err["msg"]) from exc
    _Checker(source, data, lines, pipeline).check()
    return pipeline


class _Checker:
    """The checks pydantic cannot make: ops known and allowed, arguments valid
    for their op, ids unique, references resolved, the expansion bounded."""

    def __init__(self, source: str, data: Any, lines: dict[yamlmarks.Path_, int],
                 pipeline: Pipeline) -> None:
        self.source, self.data, self.lines, self.pipeline = source, data, lines, pipeline
        self.ids: set[str] = set()
        self.output_names: set[str] = set()

    def fail(self, path: tuple[Any, ...], message: str) -> PipelineError:
        line, key = yamlmarks.locate(self.data, self.lines, path)
        return PipelineError(self.source, line, key, message)

    def check(self) -> None:
        scope = {f"inputs.{name}" for name in self.pipeline.inputs}
        outputs: set[str] = set()
        count = self._steps(self.pipeline.steps, ("steps",), scope, outputs)
        if count > MAX_INSTANCES:
            raise self.fail(("steps",), f"expands to up to {count} steps (max {MAX_INSTANCES})")
        for name, value in self.pipeline.outputs.items():
            self._refs(value, ("outputs", name), scope | {f"outputs.{o}" for o in outputs})

    def _steps(self, steps: list[Any], path: tuple[Any, ...], scope: set[str],
               outputs: set[str]) -> int:
        total = 0
        visible = {f"outputs.{o}" for o in outputs}
        for i, step in enumerate(steps):
            here = (*path, i)
            if step.id in self.ids:
                raise self.fail((*here, "id"), f"step id {step.id!r} is used twice")
            self.ids.add(step.id)
            names = scope | visible
            if isinstance(step, OpStep):
                self._op(step, here, names)
                total += 1
                if step.output is not None:
                    if step.output in self.output_names:  # a value read twice must not change
                        raise self.fail((*here, "output"),
                                        f"output {step.output!r} is named twice")
                    self.output_names.add(step.output)
                    outputs.add(step.output)
                    visible.add(f"outputs.{step.output}")
            elif isinstance(step, ForStep):
                loop = step.for_
                if isinstance(loop.items, str):
                    self._whole_ref(loop.items, (*here, "for", "items"), names)
                elif len(loop.items) > loop.max:
                    raise self.fail((*here, "for", "items"),
                                    f"{len(loop.items)} items, more than max {loop.max}")
                inner: set[str] = set(outputs)  # outputs made in the body stay in it
                body = self._steps(step.steps, (*here, "steps"),
                                   names | {loop.as_, "index"}, inner)
                total += loop.max * body
            else:
                cond = step.if_
                if f"outputs.{cond.output}" not in names:
                    raise self.fail((*here, "if", "output"),
                                    f"no earlier step has output {cond.output!r}")
                then_out, else_out = set(outputs), set(outputs)
                total += max(self._steps(step.then, (*here, "then"), names, then_out),
                             self._steps(step.else_, (*here, "else"), names, else_out))
            if total > MAX_INSTANCES:
                raise self.fail(here, f"expands to more than {MAX_INSTANCES} steps")
        return total

    def _op(self, step: OpStep, here: tuple[Any, ...], names: set[str]) -> None:
        if step.op in REFUSED_OPS:
            raise self.fail((*here, "op"), f"op {step.op!r} is refused: {REFUSED_OPS[step.op]}")
        model = ops.model_for(step.op)  # the installed ops (actors/agent/catalog.py)
        if model is None:
            raise self.fail((*here, "op"), f"unknown op {step.op!r}")
        args = dict(step.args)
        if step.timeout_s is not None:
            if "timeout_s" not in model.model_fields:
                raise self.fail((*here, "timeout_s"), f"op {step.op!r} takes no timeout")
            args["timeout_s"] = step.timeout_s
        for key, value in args.items():
            self._refs(value, (*here, "args", key), names)
        try:
            model.model_validate({"op": step.op, **_placeholders(args)})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = tuple(err["loc"])
            raise self.fail((*here, "args", *loc), err["msg"]) from exc

    def _refs(self, value: Any, path: tuple[Any, ...], names: set[str]) -> None:
        if isinstance(value, str):
            for ref in TEMPLATE.findall(value):
                self._ref(ref.strip(), path, names)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self._refs(item, (*path, i), names)
        elif isinstance(value, dict):
            for key, item in value.items():
                self._refs(item, (*path, key), names)

    def _whole_ref(self, value: str, path: tuple[Any, ...], names: set[str]) -> None:
        match = TEMPLATE.fullmatch(value.strip())
        if match is None:
            raise self.fail(path, "items must be a list or one ${...} reference")
        self._ref(match.group(1).strip(), path, names)

    def _ref(self, ref: str, path: tuple[Any, ...], names: set[str]) -> None:
        if not REF.match(ref):
            raise self.fail(path, f"bad reference ${{{ref}}}")
        if ref.startswith("outputs."):
            head = ".".join(ref.split(".")[:2])
            if head not in names:
                raise self.fail(path, f"${{{ref}}}: no earlier step in scope has that output")
        elif ref not in names:
            raise self.fail(path, f"${{{ref}}}: not an input or a loop variable in scope")


def _placeholders(value: Any) -> Any:
    """Arguments with each templated string made a plain one, to check types."""
    if isinstance(value, str):
        return TEMPLATE.sub("x", value)
    if isinstance(value, list):
        return [_placeholders(v) for v in value]
    if isinstance(value, dict):
        return {k: _placeholders(v) for k, v in value.items()}
    return value
