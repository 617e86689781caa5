"""`python -m ops.profile_step [--steps N] [--out DIR]`: where a durable step's
CPU goes, in the agent process and in the writer (docs/performance.md).

One real writer; one agent (`bench.py step`'s corral worker, the real loop
with the scripted model) first takes a few warm-up steps in a throw-away
session, so imports and pydantic's schema building are out of the figures;
then a second agent takes N steps under cProfile with a CPU clock
(`time.process_time`: waits for acks and fsyncs cost nothing, only the
process's own work counts) while py-spy samples the writer (idle frames
excluded). It prints:

- `agent_cpu_ms_per_step`, `writer_cpu_ms_per_step`: the processes' CPU
  (process_time, psutil) over the profiled steps;
- `agent_self`: top functions by own CPU time, `agent_cumulative`: top
  functions of the repository by cumulative CPU time (what each part of a
  step costs, callees included);
- `writer_self`: the writer's top functions by own samples (py-spy).

Raw outputs (pstats, py-spy's collapsed stacks) stay in --out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import psutil

from ops.benchkit import REPO_ROOT, start_writer, stop, temp_state_root, wait_writer_ready
from ops.profile_append import _pyspy, collapsed_self_top

TOP = 20
WARM_STEPS = 5


def _cumulative_top(stats: pstats.Stats, total: float, top: int) -> list[tuple[str, float]]:
    """The repository's own functions by cumulative time, share of the total."""
    entries = stats.stats  # type: ignore[attr-defined]
    ours = [(k, v) for k, v in entries.items() if str(k[0]).startswith(str(REPO_ROOT))
            and "/.venv/" not in str(k[0]) and "/ops/" not in str(k[0])]
    rows = sorted(ours, key=lambda kv: kv[1][3], reverse=True)[:top]
    return [(f"{func} ({Path(file).relative_to(REPO_ROOT)}:{line})",
             round(100 * v[3] / total, 1)) for (file, line, func), v in rows]


def _self_top(stats: pstats.Stats, total: float, top: int) -> list[tuple[str, float]]:
    entries = stats.stats  # type: ignore[attr-defined]
    rows = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{func} ({Path(file).name}:{line})", round(100 * v[2] / total, 1))
            for (file, line, func), v in rows]


def profile(out: Path, steps: int, top: int = TOP) -> dict[str, object]:
    from broker.statedir import StateDir
    from ops.bench_step import corral_worker

    with temp_state_root() as root:
        state = StateDir(root / ".corral").ensure()
        writer = start_writer(state.root)
        try:
            wait_writer_ready(state.root)
            corral_worker(state.root, "agent-warm", WARM_STEPS, barrier=False)
            proc = psutil.Process(writer.pid)
            spy = _pyspy(writer.pid, 600, out / "writer-step.txt")
            before = proc.cpu_times()
            prof = cProfile.Profile(time.process_time)
            prof.enable()
            result = corral_worker(state.root, "agent-1", steps, barrier=False)
            prof.disable()
            after = proc.cpu_times()
            prof.dump_stats(out / "agent-step-cpu.pstats")
        finally:
            stop(writer)  # py-spy ends with its target and writes its output
            spy.wait(timeout=120)
    stats = pstats.Stats(str(out / "agent-step-cpu.pstats"))
    total = sum(v[2] for v in stats.stats.values()) or 1.0  # type: ignore[attr-defined]
    writer_cpu = (after.user + after.system) - (before.user + before.system)
    ms = sorted(result["step_ms"])
    return {
        "steps": steps,
        "step_ms_p50_under_profiler": round(ms[len(ms) // 2], 2),
        "agent_cpu_ms_per_step": round(1000 * total / steps, 2),
        "agent_cpu_ms_per_step_unprofiled_clock": round(1000 * float(result["cpu_s"]) / steps, 2),
        "writer_cpu_ms_per_step": round(1000 * writer_cpu / steps, 2),
        "agent_self": _self_top(stats, total, top),
        "agent_cumulative": _cumulative_top(stats, total, top),
        "writer_self": collapsed_self_top(out / "writer-step.txt", top),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("/tmp/corral-profile-step"))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(profile(args.out, args.steps), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
