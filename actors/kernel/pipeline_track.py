"""What a pipeline run's fold keeps (`AgentState.pipeline`). Bounded.

A call aborted with its effect not applied is not settled: its step is
issued again. See docs/pipelines.md ("How a run runs").
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepMeta(_Model):
    id: str
    output: str | None = None  # the output's key ("notes", "w#2" inside a loop)
    stop: bool = True  # a failure halts the pipeline (on_error: stop)
    run_sha256: str | None = None  # the run file's digest the runner planned from


class PipelineTrack(_Model):
    done: int = 0  # settled step instances: the runner's position
    batch: dict[int, StepMeta] = Field(default_factory=dict)  # the open turn's steps
    outputs: dict[str, dict[str, Any]] = Field(default_factory=dict)  # key -> status, result
    halted: str | None = None  # the id of the step whose failure stopped the run
    halt_status: str | None = None
    run_sha256: str | None = None  # the run file's digest at the first batch


def on_turn(track: PipelineTrack | None, metas: Any) -> PipelineTrack | None:
    """A new turn: remember which step each of its actions is."""
    if not isinstance(metas, list):
        if track is not None:
            track.batch = {}
        return track
    track = track if track is not None else PipelineTrack()
    track.batch = {}
    for i, meta in enumerate(metas):
        if isinstance(meta, dict):
            try:
                track.batch[i] = StepMeta.model_validate(meta)
            except ValueError:
                continue
            if track.run_sha256 is None:
                track.run_sha256 = track.batch[i].run_sha256
    return track


def on_settled(track: PipelineTrack | None, index: int, status: str, result: Any) -> None:
    """The action at `index` of the open turn got its result."""
    if track is None:
        return
    meta = track.batch.pop(index, None)
    if meta is None:
        return
    track.done += 1
    if meta.output is not None:
        track.outputs[meta.output] = {"status": status, "result": result}
    if status != "ok" and meta.stop and track.halted is None:
        track.halted, track.halt_status = meta.id, status


def on_aborted(track: PipelineTrack | None, index: int, applied: bool) -> None:
    """A crash left the action at `index` started without a result: settled only
    when its effect is on disk (it is not run again), else issued again."""
    if track is None or not applied:
        return
    meta = track.batch.pop(index, None)
    if meta is None:
        return
    track.done += 1
    if meta.output is not None:
        track.outputs[meta.output] = {"status": "applied", "result": {"effect_applied": True}}


def result_may_wait(track: PipelineTrack | None, index: int) -> bool:
    """Whether the result of the open turn's step at `index` (a local op) may
    join the next group of facts rather than be made durable on its own: no
    later step reads it (it has no named output). Lost in a crash, the step is
    found started without a result, and the agent's rule settles it from the
    file digests (applied: never run again) or issues it again (not applied),
    so the run goes on exactly as it would have."""
    if track is None:
        return False
    meta = track.batch.get(index)
    return meta is not None and meta.output is None


def halted_before(track: PipelineTrack | None, index: int) -> bool:
    """Whether the open turn's step at `index` must not run: a step before it
    failed and halted the pipeline (the rest of its batch never runs)."""
    return track is not None and track.halted is not None and index in track.batch
