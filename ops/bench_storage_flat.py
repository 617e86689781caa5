"""`bench.py storage-flat`: caps hold over a long run (issue 16, docs/storage.md).

    python ops/bench.py storage-flat --json            (50 agents, 180 s; --quick: 10, 60 s)
    python ops/bench_storage_flat.py --agents N --seconds S [--json]

It starts the real runtime (`supervisor up`) in a fresh state directory with
a `storage:` configuration of small caps (job logs per session and in all,
snapshot generations, the WAL's rewind horizon and byte cap; the writer's
segments are 256 KiB so retention has sealed segments to remove), and N
scripted agents whose task runs background commands without end: each pass
`bash_start`s a command printing `OUTPUT_BYTES` and `bash_poll`s it. Every
`--sample-s` it runs `supervisor du --json` (the CLI, as an operator would)
and records the bytes under `.corral/`, the WAL's and the job logs'.

Figures: `samples` (t, total, wal, procs, ledgers, agents' state, transcripts,
logs, agents running), `warmup_bytes` (the
first sample at or after `warmup_fraction` of the run), `end_bytes` (the last
sample), `ratio_end_to_warmup` (target: flat, <= 1.1), `ratio_max_to_warmup`
(the highest sample after warm-up), `head_seq` (records written: the work
done), `wal_records_left` and the caps. Not a timed test: a measurement."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from broker.lifeline import die_with_parent
from broker.statedir import StateDir

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_BYTES = 4096
SEGMENT_BYTES = 256 * 1024
STORAGE = {
    "max_bytes": 16 * 1024 * 1024,
    "wal_max_bytes": 1024 * 1024,
    "procs_max_bytes": 2 * 1024 * 1024,
    "procs_max_bytes_per_session": 4 * OUTPUT_BYTES,
    "keep_generations": 2,
    "keep_records": 1000,
    "interval_s": 2.0,
    "transcript_max_bytes": 8 * 1024,
}
SNAPSHOT_EVERY = 16  # with keep_generations 2: the WAL window agents pin (docs/storage.md)
# the agents' context, bounded as a model's window bounds it (actors/agent/
# compaction.py): without it each agent's snapshot (and each kept generation)
# grows by an exchange a turn up to RECENT_MAX (256, ~300 KB a file), far past
# max_bytes for 50 agents, and a slow run is still warming up at its end
COMPACTION = {"window_tokens": 2048, "trigger_share": 0.75, "keep_share": 0.3,
              "summary_chars": 1000}
LOGGING = {"max_bytes": 64 * 1024, "backups": 1}  # each actor's log, rotated by size


def write_config(root: Path, agents: int) -> Path:
    """The default configuration with N agents, the small caps above, and a
    writer with small segments (its `command`, with the storage options the
    supervisor would add)."""
    from supervisor.storage import StorageConfig

    data = yaml.safe_load((REPO_ROOT / "config" / "default.yaml").read_text())
    data["storage"] = dict(STORAGE)
    data["agents"].update(count=agents, restart="transient")
    data.setdefault("agent", {})["snapshot_every"] = SNAPSHOT_EVERY
    data["agent"]["compaction"] = dict(COMPACTION)
    data.setdefault("logging", {}).update(LOGGING)
    for child in data["children"]:
        if child["kind"] == "writer":
            child["command"] = [
                "{python}", "-m", "actors.writer", "--state-dir", "{state_dir}",
                "--segment-bytes", str(SEGMENT_BYTES),
                *StorageConfig.model_validate(STORAGE).writer_args(),
            ]
    path = root / "storage-flat.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_task(root: Path) -> Path:
    """Background commands without end (the run is stopped, not finished)."""
    command = f"head -c {OUTPUT_BYTES} /dev/zero | tr '\\0' o; echo; echo pass {{i}}"
    task = {
        "name": "storage-flat",
        "prompt": "Run background commands and read their output.",
        "repeat": 1_000_000,
        "steps": [
            {"op": "bash_start", "command": command},
            {"op": "bash_poll", "proc_id": "{last_command}"},
        ],
    }
    path = root / "storage-flat-task.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def write_specs(state_dir: StateDir, config: Path, agents: int, task: Path) -> None:
    from actors.kernel.settings import AgentSettings, AgentSpec, Budget, write_spec

    settings = AgentSettings.model_validate(yaml.safe_load(config.read_text()).get("agent", {}))
    settings = settings.model_copy(update={"max_turns": 10_000_000, "budget": Budget()})
    for i in range(1, agents + 1):
        write_spec(state_dir, f"agent-{i}", AgentSpec(task=str(task), settings=settings))


def du(state_dir: StateDir, config: Path, env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "du", "--state-dir", str(state_dir.root),
         "--config", str(config), "--json"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120, check=True,
    )
    data: dict[str, object] = json.loads(done.stdout)
    return data


def _procs_bytes(usage: dict[str, object]) -> int:
    sessions = usage.get("sessions")
    if not isinstance(sessions, dict):
        return 0
    return sum(int(s.get("procs", 0)) for s in sessions.values() if isinstance(s, dict))


def _agent_state_bytes(usage: dict[str, object]) -> int:
    """Agents' snapshots, generations and other files but job logs and workspaces."""
    sessions = usage.get("sessions")
    if not isinstance(sessions, dict):
        return 0
    return sum(int(s.get("generations", 0)) + int(s.get("other", 0))
               for s in sessions.values() if isinstance(s, dict))


def _ledger_bytes(state_dir: StateDir) -> int:
    """The ledgers under state/ (recovery-core, never collected: docs/storage.md)."""
    return sum(p.stat().st_size for p in state_dir.state_dir.glob("*ledger*"))


def _records_left(state_dir: StateDir) -> int:
    """Records still in the WAL's segments (the head seq says how many were written)."""
    from actors.writer.wal import list_segments

    count = 0
    for _, path in list_segments(state_dir.wal_dir):
        with open(path, "rb") as f:
            count += sum(1 for _ in f)
    return count


def _head_seq(state_dir: StateDir) -> int:
    from actors.writer.wal import list_segments, parse_record

    segments = list_segments(state_dir.wal_dir)
    if not segments:
        return 0
    last = 0
    with open(segments[-1][1], "rb") as f:
        for line in f:
            record = parse_record(line)
            if record is not None:
                last = record.seq
    return last


def measure(agents: int, seconds: float, sample_s: float, warmup_fraction: float,
            keep: bool = False) -> dict[str, object]:
    from ops.soak import _env, stop_supervisor
    from ops.soakruntime import MARKER_ENV, Control, kill_group, orphans, wait_runtime_up
    from supervisor.storage import tree_bytes

    root = Path(tempfile.mkdtemp(prefix="corral-storage-flat-", dir="/tmp"))
    state_dir = StateDir(root / ".corral").ensure()
    marker = uuid.uuid4().hex
    config = write_config(root, agents)
    write_specs(state_dir, config, agents, write_task(root))
    env = _env(None)
    out = open(root / "supervisor.out", "wb")  # noqa: SIM115 - handed to the child
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
         "--config", str(config)],
        env={**env, MARKER_ENV: marker}, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=partial(die_with_parent, os.getpid()),  # noqa: PLW1509 - no thread yet
    )
    out.close()
    control = Control(state_dir)
    samples: list[dict[str, object]] = []
    figures: dict[str, object] = {}
    try:
        wait_runtime_up(control, supervisor, str(root / "supervisor.out"))
        t0 = time.monotonic()
        next_at = t0
        while True:
            now = time.monotonic()
            if now < next_at:
                time.sleep(next_at - now)  # the sampling period (a measurement, not a sync)
            t = time.monotonic() - t0
            usage = du(state_dir, config, env)
            children = control.children(timeout_s=2.0) or []
            samples.append({
                "t_s": round(t, 1),
                "total_bytes": usage["total_bytes"],
                "wal_bytes": usage["wal_bytes"],
                "procs_bytes": _procs_bytes(usage),
                "ledger_bytes": _ledger_bytes(state_dir),
                "agent_state_bytes": _agent_state_bytes(usage),
                "transcript_bytes": tree_bytes(state_dir.root / "sessions"),
                "log_bytes": tree_bytes(state_dir.logs_dir),
                "tiers": usage["tiers"],
                "agents_running": sum(
                    1 for c in children if c.kind == "agent" and c.state == "running"),
            })
            if t >= seconds:
                break
            next_at += sample_s
        figures["head_seq"] = _head_seq(state_dir)
        figures["supervisor_exit"] = stop_supervisor(state_dir, supervisor)
        figures["wal_records_left"] = _records_left(state_dir)
    finally:
        control.close()
        if supervisor.poll() is None:
            kill_group(supervisor.pid)
            supervisor.wait()
        figures["orphans"] = len(orphans(marker))
        if keep:
            figures["kept"] = str(root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    warm = next(s for s in samples if float(s["t_s"]) >= warmup_fraction * seconds)  # type: ignore[arg-type]
    after = samples[samples.index(warm):]
    warm_bytes = int(warm["total_bytes"])  # type: ignore[call-overload]
    end_bytes = int(samples[-1]["total_bytes"])  # type: ignore[call-overload]
    max_bytes = max(int(s["total_bytes"]) for s in after)  # type: ignore[call-overload]
    figures.update(
        agents=agents,
        seconds=seconds,
        sample_s=sample_s,
        warmup_s=warm["t_s"],
        samples=samples,
        warmup_bytes=warm_bytes,
        end_bytes=end_bytes,
        ratio_end_to_warmup=round(end_bytes / warm_bytes, 3),
        ratio_max_to_warmup=round(max_bytes / warm_bytes, 3),
        target_ratio=1.1,
        caps={**STORAGE, "segment_bytes": SEGMENT_BYTES, "snapshot_every": SNAPSHOT_EVERY,
              "compaction": COMPACTION, "logging": LOGGING},
        output_bytes_per_command=OUTPUT_BYTES,
    )
    return figures


def run(quick: bool = False) -> dict[str, object]:
    if quick:
        return measure(agents=10, seconds=60, sample_s=5, warmup_fraction=0.4)
    return measure(agents=50, seconds=180, sample_s=10, warmup_fraction=0.4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.4)
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    figures = measure(args.agents, args.seconds, args.sample_s, args.warmup_fraction, args.keep)
    print(json.dumps(figures, indent=2, sort_keys=True) if args.json else figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
