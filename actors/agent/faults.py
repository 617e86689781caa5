"""Fault injection for tests (and only tests): SIGKILL the agent at an exact
point of the loop, once.

    CORRAL_AGENT_FAULT="<point>@<call_id>[,<point>@<call_id>...]"

Points: `before_tool_call` (the action is decided, nothing of it recorded),
`before_tool_start` (the handler ran, e.g. procs started a command, and
nothing of it is recorded), `after_tool_start` (recorded as started, its
effect not yet applied),
`after_effect` (effect applied, no `tool_result`), `after_tool_result`;
keyed by turn (`t<turn>`, the model turn about to be asked):
`before_input_consumed` (operator input pending, nothing of its delivery
recorded), `after_input_consumed` (consumption facts durable, no model
request yet), `after_model_reply` (the model answered, its `turn` not
recorded), `after_compaction_recorded` (a compaction's record is durable, its
boundary is not; actors/kernel/compaction.py).
A fault ends the process with SIGKILL; `<point>@<call_id>:term` sends it
SIGTERM instead (an operator's stop at that point: the loop ends its step
and stops as it would on `supervisor stop`). A fault fires once per agent:
a marker file `faults/<point>@<call_id>` in the agent's directory is
written and fsynced before the kill, so the restarted process goes past it.
Unset (the normal case), `hit()` costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV_FAULT = "CORRAL_AGENT_FAULT"
POINTS = ("before_tool_call", "before_tool_start", "after_tool_start", "after_effect",
          "after_tool_result", "before_input_consumed", "after_input_consumed",
          "after_model_reply", "after_compaction_recorded")


class Faults:
    def __init__(self, agent_dir: Path, spec: str | None = None) -> None:
        spec = os.environ.get(ENV_FAULT, "") if spec is None else spec
        self.armed: dict[str, signal.Signals] = {}
        for item in (x.strip() for x in spec.split(",")):
            if item:
                name, _, how = item.partition(":")
                self.armed[name] = signal.SIGTERM if how == "term" else signal.SIGKILL
        self.marker_dir = agent_dir / "faults"

    def hit(self, point: str, call_id: str) -> None:
        if not self.armed:
            return
        name = f"{point}@{call_id}"
        how = self.armed.get(name)
        if how is None:
            return
        marker = self.marker_dir / name
        if marker.exists():
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        with open(marker, "wb") as f:
            os.fsync(f.fileno())
        fd = os.open(self.marker_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.kill(os.getpid(), how)
