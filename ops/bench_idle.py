"""`python ops/bench.py idle`: what 1,000 idle agents cost once they are up
(default configuration: each agent without a spec, joined to the broker,
supervised with heartbeats).

Figures:
    idle_agents                 agents running when the window opened
    idle_cores_<n>              CPU of the supervisor's whole process tree over
                                the window (IDLE_WINDOW_S, 30 s), in cores
    idle_cores_<n>_<kind>       the same by kind of process: supervisor,
                                zygote, writer, broker, procs, subagents,
                                agents, other
    idle_cores_machine          cores busy with anything on the machine over
                                the window (/proc/stat): what the engineers'
                                other work took is the difference
    idle_wakeups_per_s_<kind>   context switches per second by kind (voluntary
                                and not, /proc/PID/status): how often a kind
                                wakes up at all
    uss_mib_median / pss_mib_median   per idle agent
    status_cli_ms_p50           `supervisor status --json` as a whole command
    status_writes_per_s         rewrites of run/status.json during the window
    kill_to_ready_ms_p50        SIGKILL of an idle agent to its successor's
                                `actor_ready` (liveness of idle agents: from
                                the process table, not a heartbeat)

The window opens WARMUP_S after the last agent's `ready` (the start's
leftovers: the sampler's first USS reads, the zygote's pool refill) and
after the supervisor's WATCHED_S following the bench's last status request
(while someone looks, it samples every child each status interval:
supervisor/runtime/publisher.py); no request is sent to the supervisor during it.

An A/B of the broker's heartbeats, what an idle agent still pays for (each
peer and the broker beat each other every `broker.heartbeat_interval_ms`):
CORRAL_BENCH_BROKER_HEARTBEAT_MS=N runs with that interval instead of the
default configuration's.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from broker.statedir import StateDir
from ops.bench_spawn import RampCpu, Run, _busy_jiffies, _memory_mib
from supervisor.runtime.publisher import WATCHED_S

IDLE_WINDOW_S = 30.0
WARMUP_S = max(5.0, WATCHED_S + 2.0)


def _switches(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in text.splitlines()
               if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))


def _tree_switches(kinds: dict[int, tuple[str, float]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for pid, (kind, _cpu) in kinds.items():
        out[kind] = out.get(kind, 0) + _switches(pid)
    return out


def _mtime_changes(path: Path, until: float) -> int:
    """How many times `path` was replaced before `until` (polled every 50 ms)."""
    seen = 0
    last = None
    while time.monotonic() < until:
        try:
            stamp = path.stat().st_ino
        except OSError:
            stamp = None
        if last is not None and stamp != last:
            seen += 1
        last = stamp
        time.sleep(0.05)
    return seen


def _broker_beats(_state: StateDir, config: dict[str, Any]) -> None:
    beat_ms = os.environ.get("CORRAL_BENCH_BROKER_HEARTBEAT_MS")
    if beat_ms:
        config.setdefault("broker", {})["heartbeat_interval_ms"] = int(beat_ms)


def measure(count: int, window_s: float) -> dict[str, object]:
    figures: dict[str, object] = {}
    beat_ms = os.environ.get("CORRAL_BENCH_BROKER_HEARTBEAT_MS")
    if beat_ms:
        figures["broker_heartbeat_interval_ms"] = int(beat_ms)
    with tempfile.TemporaryDirectory(prefix="ci-", dir="/tmp") as tmp:
        bench = Run(Path(tmp), count, prepare=_broker_beats)
        try:
            t0 = time.time()
            last_ready = bench.wait_agents_ready_logged(timeout_s=120 + count * 0.3)
            running = bench.wait_all_running(timeout_s=30)
            figures["idle_agents"] = len(running)
            figures[f"n{count}_all_running_s"] = round((last_ready or time.time()) - t0, 2)
            time.sleep(WARMUP_S)
            cpu = RampCpu(bench.proc.pid)
            before = cpu._tree()
            sw0 = _tree_switches(before)
            jiffies0 = _busy_jiffies()
            start = time.monotonic()
            writes = _mtime_changes(bench.state.status_path, start + window_s)
            after = cpu._tree()
            wall = time.monotonic() - start
            jiffies1 = _busy_jiffies()
            sw1 = _tree_switches(after)
            spent: dict[str, float] = {}
            for pid, (kind, used) in after.items():
                spent[kind] = spent.get(kind, 0.0) + used - before.get(pid, (kind, 0.0))[1]
            figures[f"idle_cores_{count}"] = round(sum(spent.values()) / wall, 4)
            for kind, used in sorted(spent.items()):
                figures[f"idle_cores_{count}_{kind}"] = round(used / wall, 4)
            for kind in sorted(sw1):
                figures[f"idle_wakeups_per_s_{kind}"] = round(
                    (sw1[kind] - sw0.get(kind, 0)) / wall, 1)
            busy, total = jiffies1[0] - jiffies0[0], jiffies1[1] - jiffies0[1]
            figures["idle_cores_machine"] = round(
                (os.cpu_count() or 1) * busy / total, 2) if total else 0.0
            figures["status_writes_per_s"] = round(writes / wall, 2)
            figures["load_average_1m"] = round(os.getloadavg()[0], 2)
            uss, pss = _memory_mib([c.pid for c in running if c.pid])
            figures["uss_mib_median"] = uss
            figures["pss_mib_median"] = pss
            figures["supervisor_rss_mib"] = round(
                psutil.Process(bench.proc.pid).memory_info().rss / 1048576, 1)
            cli, unanswered = bench.status_cli_ms(5)
            if cli:
                figures["status_cli_ms_p50"] = round(statistics.median(cli), 1)
            figures["status_cli_unanswered"] = unanswered
            victims = running[:: max(1, len(running) // 5)][:5]
            restarts = bench.restart_ready_ms(victims)
            if restarts:
                figures["kill_to_ready_ms_p50"] = round(statistics.median(restarts), 1)
        finally:
            bench.stop()
    return figures


def run(quick: bool) -> dict[str, object]:
    count = 100 if quick else 1000
    figures: dict[str, object] = {"cpu_count": os.cpu_count(),
                                  "load_average_1m_before": round(os.getloadavg()[0], 2)}
    figures.update(measure(count, 10.0 if quick else IDLE_WINDOW_S))
    return figures
