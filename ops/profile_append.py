"""`python -m ops.profile_append [--out DIR] [--seconds S]`: where the CPU goes
on the append path and in an agent step (the figures of docs/performance.md).

Two runs, each against a fresh real writer:

- `wal`: 64 closed-loop appenders (`bench.py wal`'s), the writer sampled by
  py-spy (`py-spy record --pid ... --format raw`, idle frames excluded) for the
  length of the run; one appender process is profiled with cProfile.
- `step`: one agent taking 200 steps (`bench.py step`'s corral worker) under
  cProfile, the writer sampled by py-spy meanwhile.

For each process it prints the top functions by self time (the share of the
samples / of the profiled time spent in the function's own code). Raw outputs
(py-spy's collapsed stacks, cProfile's pstats) are kept in --out for a flame
graph (`py-spy record --format speedscope` gives the same for speedscope.app).
py-spy comes with the `bench` extra; it needs ptrace rights over the writer.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import pstats
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from ops.benchkit import start_writer, stop, temp_state_root, wait_writer_ready

TOP = 12


def _pyspy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "400",
         "--format", "raw", "--nonblocking", "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def collapsed_self_top(path: Path, top: int = TOP) -> list[tuple[str, float]]:
    """Self-time shares from py-spy's collapsed stacks ("f1;f2;f3 count")."""
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        n = int(count)
        total += n
        leaf = frames[-1]
        # "function (file.py:line)": drop the line so one function adds up
        name = leaf.rsplit(":", 1)[0] + ")" if ":" in leaf else leaf
        own[name] += n
    return [(name, round(100 * n / total, 1)) for name, n in own.most_common(top)] if total else []


def pstats_self_top(path: Path, top: int = TOP) -> list[tuple[str, float]]:
    stats = pstats.Stats(str(path))
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in entries.values()) or 1.0
    rows = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{func} ({Path(file).name}:{line})", round(100 * v[2] / total, 1))
            for (file, line, func), v in rows]


def _profiled_appender(state_dir: str, seconds: float, out: str) -> None:
    from ops.bench_wal import _appender

    recv, send = mp.get_context("fork").Pipe(duplex=False)
    prof = cProfile.Profile()
    prof.enable()
    _appender(state_dir, 999_999, time.time(), time.time() + seconds, send)
    prof.disable()
    prof.dump_stats(out)
    recv.recv()


def profile_wal(out: Path, seconds: float) -> dict[str, object]:
    from ops.bench_wal import writer_run

    with temp_state_root() as root:
        state_dir = root / ".corral"
        writer = start_writer(state_dir)
        try:
            wait_writer_ready(state_dir)
            spy = _pyspy(writer.pid, seconds + 1, out / "writer-k64.txt")
            one = mp.get_context("fork").Process(
                target=_profiled_appender, args=(str(state_dir), seconds,
                                                 str(out / "appender.pstats")))
            one.start()
            rate, _ = writer_run(state_dir, 63, seconds)
            one.join()
            spy.wait(timeout=120)
        finally:
            stop(writer)
    return {"acked_per_s_k64_under_profiler": round(rate, 1),
            "writer": collapsed_self_top(out / "writer-k64.txt"),
            "appender": pstats_self_top(out / "appender.pstats")}


def profile_step(out: Path, steps: int) -> dict[str, object]:
    from broker.statedir import StateDir
    from ops.bench_step import corral_worker

    with temp_state_root() as root:
        state = StateDir(root / ".corral").ensure()
        writer = start_writer(state.root)
        try:
            wait_writer_ready(state.root)
            spy = _pyspy(writer.pid, 600, out / "writer-step.txt")
            prof = cProfile.Profile()
            prof.enable()
            result = corral_worker(state.root, "agent-1", steps, barrier=False)
            prof.disable()
            prof.dump_stats(out / "agent-step.pstats")
        finally:
            stop(writer)  # py-spy ends with its target and writes its output
            spy.wait(timeout=120)
    ms = sorted(result["step_ms"])
    return {"step_ms_p50_under_profiler": round(ms[len(ms) // 2], 2),
            "agent": pstats_self_top(out / "agent-step.pstats"),
            "writer": collapsed_self_top(out / "writer-step.txt")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("/tmp/corral-profile"))
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"wal_k64": profile_wal(args.out, args.seconds),
              "step": profile_step(args.out, args.steps)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
