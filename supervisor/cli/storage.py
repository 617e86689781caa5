"""`supervisor du [--json]` and `supervisor gc [--dry-run] [--json]`.

See docs/storage.md ("Tiers: what may be collected").
"""

# Imports inside functions are deliberate: parsing loads neither pydantic nor
# the collectors.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.cli.command import Command, Parents

if TYPE_CHECKING:
    from broker.statedir import StateDir
    from supervisor import storage
    from supervisor.storage import StorageConfig


def _add(verb: str, text: str) -> Callable[[Any, Parents], None]:
    def add(sub: Any, parents: Parents) -> None:
        store = sub.add_parser(verb, parents=[parents.common, parents.as_json], help=text)
        store.add_argument("--config", help="configuration file (its storage: caps)")
        if verb == "gc":
            store.add_argument("--dry-run", action="store_true", help="only report")
            store.add_argument("--timeout-s", type=float, default=120.0,
                               help="how long to wait for the writer's WAL pass")

    return add


def _caps(args: argparse.Namespace) -> tuple[StateDir, StorageConfig]:
    from broker.statedir import StateDir
    from supervisor.config import load

    return (StateDir.resolve(args.state_dir),
            load(Path(args.config) if args.config else None).storage)


def _run_du(args: argparse.Namespace) -> int:
    from supervisor import storage

    state_dir, config = _caps(args)
    usage = storage.du(state_dir, config)
    if args.json:
        print(storage.as_json(usage))
    else:
        _print_usage(usage)
    return 0


def _run_gc(args: argparse.Namespace) -> int:
    from supervisor import storage

    state_dir, config = _caps(args)
    report = storage.gc(state_dir, config, dry_run=args.dry_run, timeout_s=args.timeout_s)
    if args.json:
        print(storage.as_json(report))
    else:
        _print_gc(report)
    return 0


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def _print_usage(usage: storage.Usage) -> None:
    cap = f" of {_mib(usage.max_bytes)}" if usage.max_bytes else ""
    over = "  OVER CAP" if usage.over_cap else ""
    print(f"{usage.state_dir}: {_mib(usage.total_bytes)}{cap}{over}")
    for tier, size in sorted(usage.tiers.items(), key=lambda kv: -kv[1]):
        print(f"  {tier:<14} {_mib(size):>12}")
    print(f"  (WAL {_mib(usage.wal_bytes)}; trees store {usage.tree_packs} packs, "
          f"{_mib(usage.tree_pack_bytes)})")
    for name, s in sorted(usage.sessions.items(), key=lambda kv: -kv[1].total):
        pin = " pinned" if s.pinned else ""
        print(f"  session {name}: {_mib(s.total)} (jobs {_mib(s.procs)}, generations "
              f"{_mib(s.generations)}, workspace {_mib(s.workspace)}){pin}")


def _print_gc(report: storage.GcReport) -> None:
    verb = "would remove" if report.dry_run else "removed"
    print(f"gc {verb}: {report.jobs_removed} ended jobs ({_mib(report.job_bytes_removed)}), "
          f"{report.generations_removed} generations ({_mib(report.generation_bytes_removed)}); "
          f"{report.running_jobs_kept} running jobs kept")
    if report.wal is not None:
        wal = report.wal
        print(f"  WAL: floor seq {wal.get('floor_seq')}, segments {verb}: "
              f"{len(wal.get('segments_removed') or [])}, compacted: "  # type: ignore[arg-type]
              f"{len(wal.get('segments_compacted') or [])}")  # type: ignore[arg-type]
    else:
        print(f"  WAL: {report.wal_note}")
    if report.trees is not None:
        t = report.trees
        print(f"  trees: {t.get('objects_removed')} of {t.get('objects_before')} objects "
              f"{verb}, packs rewritten {len(t.get('packs_rewritten') or [])}, "  # type: ignore[arg-type]
              f"removed {len(t.get('packs_removed') or [])}"  # type: ignore[arg-type]
              + (f"; {t['error']}" if t.get("error") else ""))
    if report.dry_run:
        print(f"  state directory: {_mib(report.bytes_before)} now; a pass would reclaim "
              f"about {_mib(reclaimable(report))} (nothing was removed)")
    else:
        print(f"  state directory: {_mib(report.bytes_before)} before the pass, "
              f"{_mib(report.bytes_after)} after"
              + ("  still OVER CAP" if report.over_cap_after else ""))


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def reclaimable(report: storage.GcReport) -> int:
    """Bytes the pass removes (or, dry, would): jobs, generations, transcripts,
    the WAL's segments, the trees store's objects."""
    total = (report.job_bytes_removed + report.generation_bytes_removed
             + report.transcript_bytes_removed)
    if report.wal is not None:
        total += max(0, _int(report.wal.get("wal_bytes_before"))
                     - _int(report.wal.get("wal_bytes_after")))
    if report.trees is not None:
        total += max(0, _int(report.trees.get("bytes_before"))
                     - _int(report.trees.get("bytes_after")))
    return total


COMMANDS = (
    Command("du", _add("du", "storage usage per tier and per session"), _run_du),
    Command("gc", _add("gc", "run a storage collection pass now (docs/storage.md)"), _run_gc),
)
