"""The soak's torn-tail cuts keep to their budget (ops/soakruntime.py
`CutBudget`): a cut that would take acknowledged facts of more of the
soak's agents than the budget allows is not made, so the agent-level checks
always have the other agents to run on."""

from __future__ import annotations

import random
from pathlib import Path

from actors.writer.wal import encode_record, list_segments, parse_record, segment_name
from broker.statedir import StateDir
from ops.soakruntime import CutBudget, _cut_tail

AGENTS = frozenset({"agent-1", "agent-2", "agent-3"})


def _segment(root: Path, origins: list[str]) -> tuple[StateDir, Path]:
    """A state dir whose one WAL segment holds a record per origin, in order."""
    state_dir = StateDir(root)
    state_dir.wal_dir.mkdir(parents=True)
    path = state_dir.wal_dir / segment_name(1)
    lines = [
        encode_record(seq, 0.0, f"agent/{origin}", "turn", origin, f"k{seq}", None, b"{}")
        for seq, origin in enumerate(origins, start=1)
    ]
    path.write_bytes(b"".join(lines))
    return state_dir, path


def test_a_cut_over_budget_is_not_made(tmp_path: Path) -> None:
    state_dir, path = _segment(tmp_path, ["writer", "agent-1", "agent-2", "agent-3"])
    before = path.read_bytes()
    reached: set[str] = set()
    # each of the last three records is a different agent's: whichever one
    # the cut starts at, it takes at least one agent, and the budget is none
    for seed in range(20):
        assert _cut_tail(state_dir, random.Random(seed), CutBudget(AGENTS, 0), reached) is None
    assert path.read_bytes() == before
    assert reached == set()


def test_earlier_cuts_count_against_the_budget(tmp_path: Path) -> None:
    state_dir, path = _segment(tmp_path, ["writer", "agent-1", "agent-1", "agent-1"])
    size = path.stat().st_size
    budget = CutBudget(AGENTS, 1)
    # agent-2 was reached before: agent-1 would be a second one
    assert _cut_tail(state_dir, random.Random(1), budget, {"agent-2"}) is None
    # agent-1 was reached before: taking more of it reaches no new agent
    reached = {"agent-1"}
    cut = _cut_tail(state_dir, random.Random(1), budget, reached)
    assert cut is not None
    assert reached == {"agent-1"}
    assert cut.streams == ["agent/agent-1"]
    assert path.stat().st_size < size
    kept = path.read_bytes().splitlines(keepends=True)
    # whole records before the cut, the torn one (if any) last
    assert all(parse_record(line) is not None for line in kept[:-1])
    assert parse_record(kept[0]) is not None


def test_a_cut_within_budget_records_whom_it_reached(tmp_path: Path) -> None:
    state_dir, path = _segment(tmp_path, ["writer", "agent-1", "agent-2", "agent-3"])
    size = path.stat().st_size
    reached: set[str] = set()
    cut = _cut_tail(state_dir, random.Random(3), CutBudget(AGENTS, 3), reached)
    assert cut is not None
    assert reached == {s.removeprefix("agent/") for s in cut.streams}
    assert reached
    assert path.stat().st_size < size
    assert [p for _, p in list_segments(state_dir.wal_dir)] == [path]
