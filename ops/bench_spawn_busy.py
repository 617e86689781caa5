"""`python ops/bench.py spawn-busy [--json] [--quick]`: the busy variant of the
spawn benchmark. N agents (default 300) each loop on a command that takes
longer than nothing (`sleep 5`, default) for a duration (default 180 s) under
the default heartbeat settings; then the worst frames within the protocol's
limits are timed through `broker.protocol.decode`.

Run it small directly:

    python ops/bench_spawn_busy.py --agents 30 --duration-s 30 --command-s 5 --json

Figures:
    busy_heartbeat_kills        children SIGKILLed as unresponsive during the run
                                (`child_unresponsive` in the supervisor's log);
                                target 0: a slow command is not a hang
    busy_heartbeat_kills_by_kind   the same, per kind (agent, procs, writer, ...)
    busy_restarts_total         restarts of every child, from `supervisor status`
    busy_agents_running         agents running at the end (of busy_agents)
    busy_calls_total            tool calls the agents completed (heartbeat values)
    busy_seen_in_call_max       most agents `supervisor status` showed busy in a call
                                at one sample; busy_since_max_s the longest such call
    busy_ops_sampled            which calls status showed the agents in, summed over
                                the samples (bash, append, model, read)
    busy_core_cpu_percent_max   the busiest sample of the writer, broker and procs
    busy_heartbeats_withheld    beats the children's watchdogs held back (a main
                                thread that showed no life): 0 in a healthy run
    busy_supervisor_gaps        times the supervisor's loop stalled past its gap
                                threshold (supervisor_resumed_after_gap), and the
                                longest (busy_supervisor_gap_max_s)
    worst_frame_decode_ms       the slowest decode of the worst frames (median of 3);
                                target <= 20. Per frame: decode_ms_<name>, and the
                                baseline decode_ms_append_1mib (a 1 MiB append whose
                                payload is one bytes field) in the same run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run directly: import the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
import yaml

from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
from broker import protocol
from broker.errors import ProtocolError
from broker.statedir import StateDir
from ops.bench_spawn import Run

FULL = {"agents": 300, "duration_s": 180.0, "command_s": 5.0}
QUICK = {"agents": 20, "duration_s": 20.0, "command_s": 5.0}


# --- the worst frames within the limits ---------------------------------------------------
def _frame(extra: Any) -> bytes:
    """A `ping` frame carrying `extra` in an additional key: every byte of it is
    unpacked and counted by decode before the model refuses the unknown key."""
    return bytes(msgpack.packb({"v": 1, "kind": "ping", "msg_id": "m1", "x": extra},
                               use_bin_type=True))


def worst_frames(limits: protocol.Limits = protocol.DEFAULT_LIMITS) -> dict[str, bytes]:
    """Frames that each stay inside every documented limit (size, depth, map
    and array lengths) while making the decoder do as much work as possible."""
    keys = limits.max_map_len - 10
    deep: Any = []
    for _ in range(limits.max_depth - 4):  # ping map, x map, a list, then this nest
        deep = [deep]
    frames = {
        # the frame: 990 keys each holding 1,040 empty arrays
        "empty_arrays": _frame({f"k{i:03d}": [[]] * 1040 for i in range(keys)}),
        # as deep as allowed, as often as fits
        "deep_nesting": _frame({f"k{i:03d}": [deep] * 80 for i in range(keys)}),
        # many one-character strings
        "tiny_strings": _frame({f"k{i:03d}": ["a"] * 520 for i in range(keys)}),
        # many empty maps
        "tiny_maps": _frame({f"k{i:03d}": [{}] * 1040 for i in range(keys)}),
        # many floats
        "floats": _frame({f"k{i:03d}": [0.5] * 115 for i in range(keys)}),
    }
    return {name: f for name, f in frames.items() if len(f) <= limits.max_frame_bytes}


def _decode_ms(frame: bytes, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        with contextlib.suppress(ProtocolError):  # a refusal is an answer: its time counts
            protocol.decode(frame)
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 3)


def decode_figures() -> dict[str, Any]:
    out: dict[str, Any] = {}
    frames = worst_frames()
    for name, frame in frames.items():
        out[f"decode_ms_{name}"] = _decode_ms(frame)
        out[f"frame_bytes_{name}"] = len(frame)
    append = protocol.encode(protocol.Append(
        msg_id="m1", origin="o", key="k", stream="s", event="e",
        payload=b"x" * (protocol.DEFAULT_LIMITS.max_frame_bytes - 200)))
    out["decode_ms_append_1mib"] = _decode_ms(append)
    out["worst_frame_decode_ms"] = max(out[f"decode_ms_{n}"] for n in frames)
    out["worst_frame"] = max(frames, key=lambda n: out[f"decode_ms_{n}"])
    return out


# --- busy agents ----------------------------------------------------------------------------
def looping_on(command_s: float) -> Callable[[StateDir, dict[str, Any]], None]:
    """A `Run` preparation: every agent gets a spec whose task loops on
    `sleep command_s` (restart transient, no turn or budget bound)."""

    def prepare(state: StateDir, config: dict[str, Any]) -> None:
        task = state.root.parent / "busy.yaml"
        task.write_text(yaml.safe_dump({"name": "busy", "steps": [
            {"op": "bash", "command": f"sleep {command_s:g}", "timeout_s": command_s * 6}],
            "repeat": 100_000}))
        config["agents"]["restart"] = "transient"
        config["agent"]["max_turns"] = 100_000
        config["agent"]["budget"] = {"tokens": None, "cost_units": None}
        config["children"] = [c for c in config["children"] if c["kind"] != "subagents"]
        settings = AgentSettings.model_validate(config["agent"])
        for i in range(1, config["agents"]["count"] + 1):
            write_spec(state, f"agent-{i}", AgentSpec(task=str(task), settings=settings))

    return prepare


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    """The log events called `name` in one JSON log file (rotated ones too)."""
    found = []
    for part in sorted(path.parent.glob(path.name + "*")):
        for line in part.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == name:
                found.append(event)
    return found


def _unresponsive(run: Run) -> dict[str, int]:
    by_kind: dict[str, int] = {}
    for event in _events(run.state.log_path("supervisor"), "child_unresponsive"):
        child = str(event.get("child", "?"))
        kind = "agent" if child.startswith("agent-") else child
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return by_kind


def _log_figures(run: Run) -> dict[str, Any]:
    gaps = _events(run.state.log_path("supervisor"), "supervisor_resumed_after_gap")
    withheld = sum(len(_events(path, "heartbeat_withheld"))
                   for path in run.state.logs_dir.glob("*.log"))
    return {"busy_supervisor_gaps": len(gaps),
            "busy_supervisor_gap_max_s": max((float(g.get("gap_s", 0)) for g in gaps),
                                             default=0.0),
            "busy_heartbeats_withheld": withheld}


def busy_figures(root: Path, agents: int, duration_s: float, command_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"busy_agents": agents, "busy_duration_s": duration_s,
                           "busy_command_s": command_s}
    bench = Run(root, agents, looping_on(command_s))
    try:
        t0 = time.perf_counter()
        running = bench.wait_all_running(timeout_s=120 + agents * 0.5)
        out["busy_all_running_s"] = round(time.perf_counter() - t0, 1)
        out["busy_agents_started"] = len(running)
        seen_max, since_max = 0, 0.0
        ops: dict[str, int] = {}
        cpu: dict[str, float] = {}
        until = time.monotonic() + duration_s
        while time.monotonic() < until:
            children = bench.status()
            busy = [c for c in children if c.kind == "agent" and c.busy is not None]
            seen_max = max(seen_max, len(busy))
            since_max = max([since_max, *(c.busy.since_s for c in busy if c.busy)])
            for c in busy:
                if c.busy is not None:
                    ops[c.busy.op] = ops.get(c.busy.op, 0) + 1
            for c in children:
                if c.kind != "agent" and c.cpu_percent is not None:
                    cpu[c.name] = max(cpu.get(c.name, 0.0), c.cpu_percent)
            time.sleep(min(2.0, max(0.0, until - time.monotonic())))  # the sampling period
        out["busy_ops_sampled"] = ops  # which calls the agents were seen in, summed
        out["busy_core_cpu_percent_max"] = cpu  # writer, broker, procs: busiest sample
        children = bench.status()
        agents_now = [c for c in children if c.kind == "agent"]
        out["busy_agents_running"] = sum(1 for c in agents_now if c.state == "running")
        out["busy_calls_total"] = int(sum(c.values.get("tool_calls", 0) for c in agents_now))
        out["busy_restarts_total"] = sum(c.restarts for c in children)
        out["busy_seen_in_call_max"] = seen_max
        out["busy_since_max_s"] = round(since_max, 1)
    finally:
        bench.stop()
    kills = _unresponsive(bench)
    out["busy_heartbeat_kills"] = sum(kills.values())
    out["busy_heartbeat_kills_by_kind"] = kills
    out.update(_log_figures(bench))
    return out


def run(quick: bool, agents: int | None = None, duration_s: float | None = None,
        command_s: float | None = None) -> dict[str, Any]:
    size = QUICK if quick else FULL
    figures: dict[str, Any] = {}
    figures.update(decode_figures())
    with tempfile.TemporaryDirectory(prefix="cbb-", dir="/tmp") as tmp:
        figures.update(busy_figures(
            Path(tmp), int(agents or size["agents"]), float(duration_s or size["duration_s"]),
            float(command_s or size["command_s"])))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=FULL["agents"])
    parser.add_argument("--duration-s", type=float, default=FULL["duration_s"])
    parser.add_argument("--command-s", type=float, default=FULL["command_s"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = run(False, args.agents, args.duration_s, args.command_s)
    print(json.dumps(figures, indent=2, sort_keys=True) if args.json else figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
