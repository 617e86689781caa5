"""The soak test's agent invariants, read offline from the WAL and the disk.

See docs/soak.md ("What it checks (`ops/soakcheck.py`, `ops/soakagents.py`)").
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.kernel import generations
from actors.kernel.fold import fold
from actors.kernel.settings import read_spec, workspace_for
from actors.kernel.state import AgentState
from actors.writer.wal import list_segments, parse_record
from broker.statedir import StateDir

Event = tuple[int, str, Any]


def _change_set_applications(state_dir: StateDir) -> dict[str, int]:
    """changeset id -> how many `subagent_applied` facts name it."""
    counts: dict[str, int] = defaultdict(int)
    for _, path in list_segments(state_dir.wal_dir):
        with open(path, "rb") as f:
            for line in f:
                if b'"event":"subagent_applied"' not in line:
                    continue
                record = parse_record(line)
                if record is not None and record.event == "subagent_applied":
                    payload = record.payload()
                    if isinstance(payload, dict):
                        counts[str(payload.get("changeset_id"))] += 1
    return counts


def expected_workspace(repeat: int) -> dict[str, bytes]:
    """What the soak task (ops/soak.py write_task) leaves, each op applied once."""
    from ops.soak import CHILD_CONTENT, CHILD_FILE, CHILD_TASK_FILE, child_task_text

    files = {
        "log.txt": ("log\n" + "".join(f"pass {i}\n" for i in range(repeat)) + "end\n").encode(),
        "release/plan.md": b"plan\n",
        CHILD_FILE: CHILD_CONTENT.encode(),
        CHILD_TASK_FILE: child_task_text().encode(),
    }
    files.update({f"work/{i}.txt": f"item {i}\n".encode() for i in range(repeat)})
    return files


@dataclass
class _WalView:
    events: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    commands: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    secret_leaks: int = 0


def _read_wal(state_dir: StateDir) -> _WalView:
    """Each agent's stream, the command digests procs started for each
    session, and the records that hold the soak's terminal secret."""
    from ops.soak import TERMINAL_SECRET

    view = _WalView()
    events, commands = view.events, view.commands
    secret = TERMINAL_SECRET.encode()
    for _, path in list_segments(state_dir.wal_dir):
        with open(path, "rb") as f:
            for line in f:
                record = parse_record(line)
                if record is None:
                    continue
                if secret in line and not _shows_terminal_output(record.event, record.payload()):
                    view.secret_leaks += 1
                if record.stream.startswith("agent/"):
                    events[record.stream.removeprefix("agent/")].append(
                        (record.seq, record.event, record.payload())
                    )
                elif record.stream.startswith("procs/") and record.event == "proc_start":
                    payload = record.payload()
                    if isinstance(payload, dict):
                        commands[record.stream.removeprefix("procs/")].append(
                            str(payload.get("command_sha256"))
                        )
    return view


def _shows_terminal_output(event: str, payload: object) -> bool:
    return event == "tool_result" and isinstance(payload, dict) and (
        payload.get("op") == "terminal_read")


def _workspace_files(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _differing_files(actual: dict[str, bytes], expected: dict[str, bytes]) -> str:
    """Which files differ and how, in a few words (the soak's example line)."""
    words = []
    for path in sorted(set(actual) | set(expected)):
        if path not in actual:
            words.append(f"{path} missing")
        elif path not in expected:
            words.append(f"{path} unexpected ({len(actual[path])} bytes)")
        elif actual[path] != expected[path]:
            words.append(
                f"{path} {len(actual[path])} bytes, expected {len(expected[path])}: "
                f"{actual[path][-60:]!r}"
            )
    return "; ".join(words[:5]) + (f" (+{len(words) - 5} more)" if len(words) > 5 else "")


def _effects_disagree(events: list[Event], workspace: Path) -> int:
    """Files whose digest is not the after_sha of the last applied write."""
    started: dict[str, dict[str, Any]] = {}
    last: dict[str, str | None] = {}
    for _, event, payload in events:
        if event == "tool_start" and isinstance(payload.get("effect"), dict):
            started[payload["call_id"]] = payload["effect"]
        elif event == "tool_result" and payload.get("call_id") in started:
            effect = started.pop(payload["call_id"])
            if payload.get("status") == "ok":
                last[str(effect["path"])] = effect.get("after_sha")
        elif event == "turn_aborted":
            for call in payload.get("calls", []):
                effect = started.pop(str(call.get("call_id")), {})
                if effect and call.get("effect_applied") is True:
                    last[str(effect["path"])] = effect.get("after_sha")
    bad = 0
    for label, sha in last.items():
        if label.startswith("memory:"):
            continue
        path = workspace / label
        actual = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        bad += actual != sha
    return bad


def _state_diff(folded: dict[str, Any], reported: dict[str, Any]) -> str:
    """The fields where the generation and the fold differ, each value clipped."""
    parts = []
    for key in sorted(set(folded) | set(reported)):
        if folded.get(key) != reported.get(key):
            parts.append(f"{key}: fold={str(folded.get(key))[:300]} "
                         f"generation={str(reported.get(key))[:300]}")
    return "; ".join(parts)


def check(
    state_dir: StateDir, repeat: int | None = None, tainted: set[str] | None = None
) -> dict[str, object]:
    """Agents in `tainted` (acknowledged facts of theirs were cut by the soak)
    are skipped: their files and answers are ahead of what their WAL says."""
    wal = _read_wal(state_dir)
    all_events, commands = wal.events, wal.commands
    names = sorted(
        p.stem
        for p in (state_dir.config_dir / "agents").glob("*.json")
        if p.stem not in (tainted or set())
    )
    state_bad: list[str] = []
    workspace_bad: list[str] = []
    double = 0
    commands_twice = 0
    for name in names:
        started = commands.get(name, [])
        commands_twice += len(started) - len(set(started))
        events = all_events.get(name, [])
        child = "." in name  # a subagent's child: agent/<parent>.<subagent id>
        if child and not events:
            continue  # spawned but never started (its spawn was retried under another id)
        full = fold(AgentState(), events)
        reported = generations.newest(state_dir.agent_dir(name))
        if full.phase != "finished":
            state_bad.append(f"{name}: stream ends {full.phase}")
        elif reported is not None:
            upto = fold(AgentState(), [e for e in events if e[0] <= reported.last_seq])
            if upto.model_dump() != reported.model_dump():
                state_bad.append(f"{name}: generation at seq {reported.last_seq} differs: "
                                 f"{_state_diff(upto.model_dump(), reported.model_dump())}")
        starts = [p["call_id"] for _, ev, p in events if ev == "tool_start"]
        double += len(starts) - len(set(starts))
        spec = read_spec(state_dir, name)
        if spec is None:
            continue
        workspace = workspace_for(state_dir, name, spec)
        upper = workspace.parent / "upper"
        if child and upper.is_dir() and not os.path.ismount(workspace):
            # a copy-on-write child's view is unmounted once its change set is
            # built: what it wrote is in the overlay's upper directory
            # (docs/changesets.md, "Copy-on-write workspaces")
            workspace = upper
        if _effects_disagree(events, workspace):
            workspace_bad.append(f"{name}: a file differs from its last applied write")
        elif not child and repeat is not None:
            differing = _differing_files(_workspace_files(workspace), expected_workspace(repeat))
            if differing:
                workspace_bad.append(
                    f"{name}: workspace differs from one pass of every op: {differing}"
                )
    applications = _change_set_applications(state_dir)
    double += sum(1 for n in applications.values() if n > 1)
    return {
        "change_sets_applied": len(applications),
        "state_mismatches": len(state_bad),
        "state_mismatch_examples": state_bad[:10],
        "workspace_mismatches": len(workspace_bad),
        "workspace_mismatch_examples": workspace_bad[:10],
        "double_applies": double,
        "commands_started_twice": commands_twice,
        "secrets_in_wal": wal.secret_leaks,
    }
