"""`python ops/bench.py SUITE [--json]`: run one benchmark suite and print its
figures (JSON with --json). Each suite measures its own baselines in the same
run, so its targets are ratios that hold on a noisy machine."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SUITES = {
    "wal": "ops.bench_wal",
    "writer-restart": "ops.bench_writer_restart",
    "broker": "ops.bench_broker",
    "spawn": "ops.bench_spawn",
    "spawn-busy": "ops.bench_spawn_busy",
    "up": "ops.bench_up",  # `supervisor up` to every child running, and the tree's life
    "idle": "ops.bench_idle",  # what idle agents cost (docs/supervisor.md, "Liveness")
    "agent-recovery": "ops.bench_agent_recovery",
    "procs": "ops.bench_procs",
    "subagents": "ops.bench_subagents",
    "fileops": "ops.bench_fileops",
    "status": "ops.bench_status",
    "decode": "ops.bench_decode",
    "step": "ops.bench_step",
    "storage": "ops.bench_storage",
    "storage-flat": "ops.bench_storage_flat",
    "trees": "ops.bench_trees",
    "compaction": "ops.bench_compaction",
    "fleet": "ops.bench_fleet",
    "bridge": "ops.bench_bridge",  # messages between hosts (docs/fleet.md)
    "subagents-remote": "ops.bench_subagents_remote",  # a child on another host
    "pipeline": "ops.bench_pipeline",
    "console": "ops.bench_console",  # the web console in chromium (docs/console.md)
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = parser.parse_args()
    module = importlib.import_module(SUITES[args.suite])
    figures: dict[str, object] = module.run(quick=args.quick)
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    else:
        for key, value in sorted(figures.items()):
            print(f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
