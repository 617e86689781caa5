"""`python ops/bench.py fileops --json`: what the race-free file ops cost.

Per op, in one run on the same files: the agent's `read_file` handler and a
write as the loop applies it (`workspace.apply_write`: the fd walk without
links, a random O_EXCL temp, fsync, rename, fsync of the directory),
against the baselines of the same work by name (`open().read()`, and temp +
fsync + `os.replace` + directory fsync as the old code did). Files sit three
directories deep so the walk has components to open. Also the gate's
verdict for a path op (normalise, walk check, rules) and `search` over a
small tree. Ratios are the figures that hold on a loaded machine.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from actors.agent import builtin_ops
from actors.kernel import gate, workspace
from actors.kernel.ops import OpContext
from actors.kernel.settings import AgentSettings, Permissions, Rule
from broker.statedir import StateDir

DEPTH = ("src", "pkg", "mod")


def _p50_us(fn: Callable[[int], object], rounds: int) -> float:
    times = []
    for i in range(rounds):
        started = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - started) * 1e6)
    return round(statistics.median(times), 1)


def _paired_p50_us(a: Callable[[], object], b: Callable[[], object],
                   rounds: int) -> tuple[float, float]:
    """p50 of `a` and of `b`, called alternately (fsync times drift on a
    loaded machine: alternating keeps the two comparable)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((a, times[0]), (b, times[1])):
            started = time.perf_counter()
            fn()
            out.append((time.perf_counter() - started) * 1e6)
    return round(statistics.median(times[0]), 1), round(statistics.median(times[1]), 1)


def _write_by_name(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.corral-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run(quick: bool = False) -> dict[str, object]:
    rounds = 200 if quick else 2000
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as tmp:
        state = StateDir(Path(tmp) / ".corral").ensure()
        ws = Path(tmp) / "ws"
        deep = ws.joinpath(*DEPTH)
        deep.mkdir(parents=True)
        for n in range(50):
            (deep / f"f{n}.txt").write_text(f"line {n}\n" * 40)
        rel = "/".join([*DEPTH, "f1.txt"])
        ctx = OpContext(agent="a1", workspace=ws, memory_dir=state.memory_dir / "a1",
                        state_dir=state)
        settings = AgentSettings(permissions=Permissions(rules=[
            Rule(op="*", path="secrets/*", decision="deny")]))
        guard = workspace.guard_for(state)
        data = b"x" * 4096
        read_op = builtin_ops.ReadFile(path=rel)
        search_op = builtin_ops.Search(text="line 7", path="src", max_results=1000)
        read_us, read_by_name_us = _paired_p50_us(
            lambda: builtin_ops.read_file(read_op, ctx), (ws / rel).read_text, rounds)
        write_us, write_by_name_us = _paired_p50_us(
            lambda: workspace.apply_write(workspace.place(ws, rel, guard), data),
            lambda: _write_by_name(ws / rel, data), rounds // 4)
        figures: dict[str, object] = {
            "read_file_us_p50": read_us, "read_by_name_us_p50": read_by_name_us,
            "write_us_p50": write_us, "write_by_name_us_p50": write_by_name_us,
            "gate_decide_us_p50": _p50_us(lambda _: gate.decide(
                read_op, settings, frozenset(), ws, state), rounds),
            "search_50_files_us_p50": _p50_us(lambda _: builtin_ops.search(search_op, ctx),
                                              max(10, rounds // 20)),
            "rounds": rounds,
        }
    read_ratio = read_us / read_by_name_us
    write_ratio = write_us / write_by_name_us
    figures["read_ratio_vs_by_name"] = round(read_ratio, 2)
    figures["write_ratio_vs_by_name"] = round(write_ratio, 2)
    figures["targets"] = {"write_ratio<=1.2": write_ratio <= 1.2}
    return figures
