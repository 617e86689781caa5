"""The collector yields to the writer (actors/writer/walgc.py, GC_DUTY): while
appends flow, a pass's loop steps take at most GC_DUTY of the loop's time;
with none it steps at once; the compactor child runs at the lowest priority."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from actors.writer.walgc import GC_DUTY, Collector, GcOptions, PassResult
from broker.statedir import StateDir


def _collector(state_dir: StateDir, steps: list[float], step_s: float,
               monkeypatch: pytest.MonkeyPatch) -> Collector:
    collector = Collector(state_dir, GcOptions())
    collector._pass = PassResult(id="t")
    clock = {"now": 1000.0}
    monkeypatch.setattr("actors.writer.walgc.time",
                        SimpleNamespace(monotonic=lambda: clock["now"], time=time.time))

    def step(_w: Any) -> None:
        steps.append(clock["now"])
        clock["now"] += step_s  # the step's own duration

    monkeypatch.setattr(collector, "_tick_pass", step)
    collector.clock = clock  # type: ignore[attr-defined]
    return collector


def test_a_pass_step_waits_its_turn_while_appends_flow(
        state_dir: StateDir, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[float] = []
    collector = _collector(state_dir, steps, 0.1, monkeypatch)
    clock = collector.clock  # type: ignore[attr-defined]
    writer = SimpleNamespace(head=10)
    collector.tick(writer)
    assert steps == [1000.0]
    pause_s = 0.1 * (1 - GC_DUTY) / GC_DUTY
    writer.head = 20  # appends were acknowledged since: the writer is busy
    clock["now"] = 1000.1 + pause_s / 2
    collector.tick(writer)
    assert steps == [1000.0]  # not yet: the writer's share of the time first
    clock["now"] = 1000.1 + pause_s + 0.001
    collector.tick(writer)
    assert len(steps) == 2
    # from one step to the next, the pass took at most GC_DUTY of the loop's time
    assert 0.1 / (steps[1] - steps[0]) <= GC_DUTY + 0.01


def test_with_no_appends_a_pass_steps_at_once(
        state_dir: StateDir, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[float] = []
    collector = _collector(state_dir, steps, 0.1, monkeypatch)
    writer = SimpleNamespace(head=10)
    collector.tick(writer)
    collector.tick(writer)  # the head did not move: no wait
    assert len(steps) == 2


@pytest.mark.timeout(30)
def test_the_compactor_child_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    code = ("import os; from actors.writer.compactor import yield_to_writer; "
            "yield_to_writer(); print(os.nice(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=20, cwd=Path(__file__).resolve().parent.parent,
                         env={**os.environ})
    assert out.stdout.strip() == "19"


def test_splice_replaces_one_segments_slice_of_a_stream_and_keeps_the_rest(
        tmp_path: Path) -> None:
    """A compaction's swap rewrites the stream's slice of its segment only
    (StreamIndex.splice): entries before and after are copied as they were,
    pending ones stay pending; a range reaching into memory is refused."""
    from actors.writer.streamindex import StreamIndex

    index = StreamIndex(tmp_path / "index")
    for seq in range(1, 11):  # segment 1: seqs 1-5, segment 6: seqs 6-10
        index.add("s", seq, 1 if seq <= 5 else 6, seq * 100, 50)
    assert not index.flush()
    index.add("s", 11, 11, 0, 50)  # pending, not yet in the file
    path = index.splice("s", 6, 10, [(7, 6, 0, 50), (9, 6, 50, 50)], fsync=False)
    assert path is not None
    assert index.entries("s") == [*[(s, 1, s * 100, 50) for s in range(1, 6)],
                                  (7, 6, 0, 50), (9, 6, 50, 50), (11, 11, 0, 50)]
    assert index.splice("s", 0, 5, [], fsync=False) is not None  # below a floor: gone
    assert [e[0] for e in index.entries("s")] == [7, 9, 11]
    assert index.splice("s", 9, 11, [], fsync=False) is None  # seq 11 is in memory
    index.close()
