"""A real agent recovers after WAL retention removed its early segments
(issue 16, docs/storage.md "WAL retention"): the agent is SIGKILLed partway
through a scripted task (CORRAL_AGENT_FAULT, its effect applied and no result
recorded), a collection pass (`supervisor gc`'s code: old snapshot generations
pruned to `keep_generations`, then the writer's retention pass) removes every
sealed segment below its newest generation, and the restarted agent rebuilds
from that generation and the WAL above the floor, and finishes with the
workspace of an uninterrupted run of the same task."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from actors.kernel.settings import write_spec
from actors.writer.client import WriterClient
from actors.writer.wal import list_segments
from broker.statedir import StateDir
from supervisor.storage import StorageConfig, gc
from supervisor.walverify import verify
from tests.agentkit import spec, tree, write_task
from tests.processes import ProcessTracker
from tests.storagekit import Ctx, start_writer

pytestmark = pytest.mark.process

PASSES = 12
FAULT = "after_effect@16.0"  # a write of pass 7: applied, its result not recorded


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def run_agent(processes: ProcessTracker, sd: StateDir, name: str, label: str,
              env: dict[str, str] | None = None) -> int:
    agent = processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir", str(sd.root)],
                            name=label, env=env)
    return agent.wait(30)


def first_seq(ctx: Ctx, sd: StateDir, stream: str) -> int:
    with WriterClient(ctx, sd, "reader") as reader:
        return next(iter(reader.read_stream(stream))).seq


def test_agent_finishes_after_retention_removed_its_early_segments(
    processes: ProcessTracker, state_dir: StateDir, tmp_path: Path, ctx: Ctx
) -> None:
    start_writer(processes, state_dir, ctx, "writer", "--gc-keep-records", "5")
    processes.spawn(["-m", "broker.server", "--state-dir", str(state_dir.root)], name="broker")
    task = write_task(tmp_path / "task.yaml", [
        {"op": "edit_file", "path": "log.txt", "old": "end", "new": "pass {i}\nend"},
        {"op": "write_file", "path": "work/{i}.txt", "content": "item {i}\n"},
    ], repeat=PASSES, setup=[{"op": "write_file", "path": "log.txt", "content": "log\nend\n"}])
    workspaces = {name: tmp_path / name for name in ("killed", "whole")}
    for name, ws in workspaces.items():
        ws.mkdir()
        write_spec(state_dir, name,
                   spec(task, snapshot_every=4).model_copy(update={"workspace": str(ws)}))

    code = run_agent(processes, state_dir, "killed", "killed0", {"CORRAL_AGENT_FAULT": FAULT})
    assert code == -signal.SIGKILL, processes.output("killed0")
    first_before = first_seq(ctx, state_dir, "agent/killed")
    generations = state_dir.agent_dir("killed") / "state" / "generations"
    assert len(list(generations.glob("gen-*.json"))) >= 2  # old ones for the pass to prune

    report = gc(state_dir, StorageConfig(keep_generations=1, keep_records=5), dry_run=False,
                timeout_s=20)
    assert report.generations_removed >= 1 and report.wal is not None, report
    assert not report.wal.get("error"), report
    floor = report.wal["floor_seq"]
    assert isinstance(floor, int)
    newest = int(next(generations.glob("gen-*.json")).stem.removeprefix("gen-"))
    assert first_before < floor <= newest, (first_before, floor, newest)
    assert min(first for first, _ in list_segments(state_dir.wal_dir)) == floor
    assert first_seq(ctx, state_dir, "agent/killed") >= floor  # its early records are gone
    assert verify(state_dir).sound

    code = run_agent(processes, state_dir, "killed", "killed1", {"CORRAL_AGENT_FAULT": FAULT})
    assert code == 0, processes.output("killed1")
    assert run_agent(processes, state_dir, "whole", "whole") == 0, processes.output("whole")
    expected = tree(workspaces["whole"])
    assert expected["log.txt"].count("pass") == PASSES and len(expected) == PASSES + 1
    assert tree(workspaces["killed"]) == expected
