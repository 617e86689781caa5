"""The pipeline runner's "model": each reply is the pipeline's next steps.

It decides nothing and calls no model (usage zero). See docs/pipelines.md
("How a run runs").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.kernel.operator_input import Delivered
from actors.kernel.pipeline_track import PipelineTrack
from actors.kernel.reply import Reply, Usage
from actors.kernel.state import AgentState
from actors.pipelines import dsl, plan, runfile

SUMMARY_CHARS = 3900
CHANGED = "pipeline_changed"


def changed_since_start(track: PipelineTrack | None, digest: str) -> str | None:
    """Why the run must not go on with a run file of this digest (None: it may)."""
    if track is None or track.run_sha256 is None or track.run_sha256 == digest:
        return None
    return (f"the pipeline run file changed since the run started (sha256 "
            f"{track.run_sha256[:12]}..., now {digest[:12]}...): nothing more is run")


@dataclass
class PipelineModel:
    run: runfile.RunFile
    pipeline: dsl.Pipeline
    max_batch: int = plan.DEFAULT_BATCH
    name: str = "pipeline"
    deadline_s: float = 0.0

    @classmethod
    def from_file(cls, path: str) -> PipelineModel:
        run = runfile.read(path)
        return cls(run, run.parsed())

    def next_reply(self, state: AgentState, inputs: Sequence[Delivered] = ()) -> Reply:
        """The next batch; operator inputs (corrections, notes) are for a model
        and do not steer a pipeline: they stay in the stream, unread here. A
        run file that no longer matches the digest recorded with the first
        batch runs nothing more: the run ends failed (`pipeline_changed`)."""
        del inputs
        track = state.pipeline
        digest = self.run.digest()
        changed = changed_since_start(track, digest)
        if changed is not None:
            return self._finish("failed", changed, state, code=CHANGED)
        if track is not None and track.halted is not None:
            return self._finish("failed", f"step {track.halted} ended {track.halt_status}",
                                state)
        batch = plan.next_batch(self.pipeline, self.run.inputs, track, self.max_batch)
        if batch.failure is not None:
            return self._finish("failed", batch.failure, state)
        if batch.finished:
            return self._finish("ok", None, state)
        metas = [{**meta, "run_sha256": digest} for meta in batch.metas]
        return Reply(actions=list(batch.actions), usage=Usage(), meta=metas)

    def _finish(self, status: str, error: str | None, state: AgentState,
                code: str | None = None) -> Reply:
        summary: dict[str, Any] = {"pipeline": self.pipeline.name, "status": status}
        if error is not None:
            summary["error"] = error
        if code is not None:
            summary["code"] = code
        summary["outputs"] = ({} if code == CHANGED else
                              plan.outputs_of(self.pipeline, self.run.inputs, state.pipeline))
        text = json.dumps(summary, ensure_ascii=False, sort_keys=True)
        if len(text) > SUMMARY_CHARS:  # the outputs stay readable from the run's state
            summary["outputs"] = {"truncated": True}
            text = json.dumps(summary, ensure_ascii=False, sort_keys=True)[:SUMMARY_CHARS]
        return Reply(actions=[{"op": "finish", "summary": text}], usage=Usage())
