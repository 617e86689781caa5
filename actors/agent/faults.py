"""Fault injection for tests (and only tests): kill the agent at an exact point.

`CORRAL_AGENT_FAULT="<point>@<call_id>[:term],..."`; each fires once (a
marker file is fsynced before the kill). See docs/agents.md ("Recovery").
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
