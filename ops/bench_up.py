"""`python ops/bench.py up`: what one `supervisor up --detach` costs, from the
command to every child running, and the supervisor's whole tree over its life
(up, every child running, `supervisor stop`, exit). The test suite runs many
such cycles on two cores: it is CPU-bound, so CPU is the figure that matters.

Configuration: the packaged default (writer, broker, procs, subagents) with
CORRAL_BENCH_UP_AGENTS agents (default 1). The bench process is a child
subreaper, so the detached supervisor is its child and its whole tree's CPU
(every reaped descendant's) comes back with its exit status.

Figures (medians over the cycles; seconds):
    up_wall_s                 `up --detach` started to every child `running`
    up_cpu_s                  CPU of the tree at that moment: the supervisor,
                              its live descendants, and the ones it reaped
    up_cpu_s_<kind>           the same by process: supervisor, zygote, writer,
                              broker, procs, subagents, agents (each child's
                              own CPU, after its fork or exec)
    up_uss_mib_<kind>         memory of one process of that kind at that moment
                              (USS: its private pages; a fork shares the
                              zygote's until it writes them), agents: the median
    tree_cpu_s                the supervisor's tree over its whole life
    cycle_cpu_s               everything a cycle ran: the tree, and the `up
                              --detach` and `stop` commands
    cycle_wall_s              the cycle, `up --detach` to the supervisor's exit
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from broker import lifeline
from broker.statedir import StateDir
from ops.benchkit import child_env, temp_state_root
from supervisor.config import DEFAULT_CONFIG_PATH

AGENTS_ENV = "CORRAL_BENCH_UP_AGENTS"
READY_TIMEOUT_S = 120.0


def _cli(state: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--state-dir", str(state)],
                   env=child_env(), check=True, capture_output=True, timeout=120)


def _children(state: Path) -> list[dict[str, object]] | None:
    """Every child's row, from the status file (no request: nothing extra to pay)."""
    try:
        data = json.loads(StateDir.at(state).status_path.read_text())
    except (OSError, ValueError):
        return None
    rows: list[dict[str, object]] = data.get("children", [])
    return rows


def _cpu_s(proc: psutil.Process, *, reaped: bool = False) -> float:
    times = proc.cpu_times()
    own = float(times.user + times.system)
    return own + (float(times.children_user + times.children_system) if reaped else 0.0)


def _zygote_pid(state: Path) -> int | None:
    try:
        text = StateDir.at(state).log_path("supervisor").read_text()
    except OSError:
        return None
    pids = [json.loads(line)["pid"] for line in text.splitlines() if '"zygote_spawned"' in line]
    return int(pids[-1]) if pids else None


def _cycle(root: Path, config: Path, index: int) -> dict[str, float]:
    state = root / f"s{index}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    _cli(state, "up", "--detach", "--config", str(config))
    deadline = started + READY_TIMEOUT_S
    while True:
        rows = _children(state)
        if rows and all(r.get("state") == "running" for r in rows):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every child running: {rows}")
        time.sleep(0.01)
    up_wall_s = time.monotonic() - started
    status = json.loads(StateDir.at(state).status_path.read_text())
    sup = psutil.Process(int(status["supervisor_pid"]))
    figures = {"up_wall_s": up_wall_s}
    by_kind: dict[str, float] = {"supervisor": _cpu_s(sup, reaped=True)}
    zygote = _zygote_pid(state)
    if zygote is not None:
        by_kind["zygote"] = _cpu_s(psutil.Process(zygote))
    uss: dict[str, list[float]] = {}
    for row in rows:
        kind = "agents" if str(row["name"]).startswith("agent") else str(row["name"])
        child = psutil.Process(int(str(row["pid"])))
        by_kind[kind] = by_kind.get(kind, 0.0) + _cpu_s(child)
        uss.setdefault(kind, []).append(child.memory_full_info().uss / 2**20)
    figures.update({f"up_uss_mib_{k}": statistics.median(v) for k, v in uss.items()})
    others = {p.pid for p in sup.children(recursive=True)} - {
        int(str(r["pid"])) for r in rows} - {zygote}
    by_kind["other"] = sum(_cpu_s(psutil.Process(p)) for p in others if psutil.pid_exists(p))
    figures["up_cpu_s"] = sum(by_kind.values())
    figures.update({f"up_cpu_s_{k}": v for k, v in by_kind.items()})
    _cli(state, "stop")
    _pid, _status, usage = os.wait4(sup.pid, 0)  # ours: we are its subreaper
    figures["tree_cpu_s"] = usage.ru_utime + usage.ru_stime
    figures["cycle_wall_s"] = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures["cycle_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime
                                                                   + before.ru_stime)
    return figures


def run(*, quick: bool = False) -> dict[str, object]:
    lifeline.become_subreaper()
    cycles = 3 if quick else 5
    agents = int(os.environ.get(AGENTS_ENV, "1"))
    with temp_state_root("corral-up-") as root:
        config = root / "corral.yaml"
        data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
        data["agents"]["count"] = agents
        config.write_text(yaml.safe_dump(data))
        runs = [_cycle(root, config, i) for i in range(cycles)]
    keys = sorted({k for r in runs for k in r})
    out: dict[str, object] = {"up_cycles": cycles, "up_agents": agents}
    for key in keys:
        out[key] = round(statistics.median(r.get(key, 0.0) for r in runs), 3)
    return out
