"""What a pipeline run came to (status and outputs), read from its runner's stream.

See docs/pipelines.md ("How a run runs").
"""

from __future__ import annotations

from typing import Any

from actors.kernel.state import AgentState
from actors.pipelines import plan, runfile
from actors.pipelines.backend import CHANGED, changed_since_start
from actors.sessions.rebuild import rebuild
from broker.statedir import StateDir


def summarise(run: runfile.RunFile, state: AgentState) -> dict[str, Any]:
    pipeline = run.parsed()
    track = state.pipeline
    out: dict[str, Any] = {"pipeline": pipeline.name, "steps_settled": track.done if track else 0}
    changed = changed_since_start(track, run.digest())
    if changed is not None:  # what it reports must be what it ran, not the new file
        out.update(status="failed", error=changed, code=CHANGED, outputs={})
        return out
    if track is not None and track.halted is not None:
        out.update(status="failed", error=f"step {track.halted} ended {track.halt_status}")
    elif state.phase == "finished":
        batch = plan.next_batch(pipeline, run.inputs, track)
        out["status"] = "failed" if batch.failure else "ok"
        if batch.failure:
            out["error"] = batch.failure
    else:
        out["status"] = state.phase
    out["outputs"] = plan.outputs_of(pipeline, run.inputs, track)
    return out


def outcome(writer: Any, state_dir: StateDir, runner: str) -> dict[str, Any] | None:
    """The run's summary once its runner's session is over; None before."""
    state = rebuild(writer, state_dir, runner).state
    if state.phase not in ("finished", "closed"):
        return None
    return summarise(runfile.read(runfile.path_for(state_dir, runner)), state)
