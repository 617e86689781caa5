"""Adoption of an agent that rewound (docs/fleet.md, "Adoption of a rewound
agent"): on host A an agent runs its scripted task to the end, is rewound to
turn 3, runs on to the end again, and is rewound to turn 1; then the whole
host is SIGKILLed. Host B adopts it: the imported records name B's seqs (the
rewinds cut B's branch where A's cut A's), so their fold on B is A's fold
with every seq mapped, and the agent runs turns 2.. on B to the workspace and
state of an uninterrupted run of the same story on B (a reference agent
rewound the same way, never moved)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.kernel.fold import fold
from actors.kernel.generations import SAVED_EVENT
from actors.kernel.state import AgentState
from actors.sessions.rebuild import rebuild
from actors.trees import branch
from actors.trees.store import packs_dir
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from supervisor.fleet.adopt import stream_records, uploaded_pack_size
from tests.agentkit import tree, write_task
from tests.fleetkit import Cluster, forget_hosts, operator_key_and_hosts
from tests.processes import ProcessTracker, wait_for
from tests.test_fleet_adopt import all_uploaded, config_for
from tests.test_fleet_hosts import cli, fleet_view, other_state_dir

__all__ = ["other_state_dir"]  # the fixture, used by name

pytestmark = [pytest.mark.fleet, pytest.mark.process]

STEPS = [
    {"op": "write_file", "path": "a.txt", "content": "1\n"},
    {"op": "write_file", "path": "b.txt", "content": "bee"},
    {"op": "edit_file", "path": "a.txt", "old": "1", "new": "1+2"},
    {"op": "write_file", "path": "c/d.txt", "content": "dee"},
    {"op": "edit_file", "path": "b.txt", "old": "bee", "new": "bee+3"},
    {"op": "finish", "summary": "done"},
]
FINAL = {"a.txt": "1+2\n", "b.txt": "bee+3", "c/d.txt": "dee"}
SEQ_FIELDS = ("last_seq", "session", "session_seq", "branch", "last_rewind")


def records_of(writer: WriterClient, name: str) -> list[tuple[int, str, Any]]:
    return [(r.seq, r.event, r.payload()) for r in writer.read_stream(f"agent/{name}")]


def exits(writer: WriterClient, name: str) -> int:
    """How many times the agent finished its session (on this host)."""
    return sum(1 for _, e, p in records_of(writer, name)
               if e == "session_exit" and p.get("reason") == "finished")


def at_rest(writer: WriterClient, name: str, finishes: int) -> bool:
    """Finished `finishes` times, its last record (generation facts aside) the exit."""
    records = [r for r in records_of(writer, name) if r[1] != SAVED_EVENT]
    return exits(writer, name) == finishes and bool(records) and records[-1][1] == "session_exit"


def ok(processes: ProcessTracker, state_dir: StateDir, *args: str) -> None:
    done = cli(processes, state_dir, *args)
    assert done.returncode == 0, (args, done.stdout, done.stderr)


def rewind_to(processes: ProcessTracker, state_dir: StateDir, name: str, turn: int) -> None:
    ok(processes, state_dir, "stop", name)
    ok(processes, state_dir, "rewind", name, "--to-turn", str(turn))


def dead_records(urls: list[str], host: str, name: str) -> list[tuple[int, str, Any]]:
    import nats

    async def go() -> list[dict[str, Any]]:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            return await stream_records(nc.jetstream(timeout=5), host)
        finally:
            await nc.close()

    return [(r["seq"], r["event"], r["payload"]) for r in asyncio.run(go())
            if r.get("stream") == f"agent/{name}"]


def comparable(state: AgentState) -> dict[str, Any]:
    """A state without what names one host's seqs or one run's session id."""
    out = state.model_dump(exclude=set(SEQ_FIELDS))
    out["counts"].pop("events")  # generation facts, an adoption's vouching fact
    return out


@pytest.mark.timeout(180)  # two hosts, six rewinds and restarts, a host loss (~30 s quiet)
def test_an_agent_rewound_twice_is_adopted_with_its_branch(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir, tmp_path: Path) -> None:
    fleet_cluster.wait_ready()
    key, ha, hb = operator_key_and_hosts(state_dir.root)
    try:
        up_a = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                                "--config", str(config_for(state_dir, ha, fleet_cluster, key))],
                               name="up-a")
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(other_state_dir.root),
                         "--config", str(config_for(other_state_dir, hb, fleet_cluster, key))],
                        name="up-b")

        def both_running() -> bool:
            if not (state_dir.run_dir / "fleet.json").exists():
                return False
            view = fleet_view(processes, state_dir)
            return all(view.get(h) and view[h]["children"] and all(
                c["state"] == "running" for c in view[h]["children"]) for h in (ha, hb))

        wait_for(both_running, 90, "both hosts running", interval_s=0.3)
        task = write_task(tmp_path / "rw.yaml", STEPS)
        # B's WAL runs ahead of A's (its reference agent starts first): the same seq
        # names different records on the two hosts
        ok(processes, other_state_dir, "spawn", "ref", "--task", str(task), "--json")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            with WriterClient(ctx, state_dir, "probe-a") as writer_a, \
                    WriterClient(ctx, other_state_dir, "probe-b") as writer_b:
                wait_for(lambda: at_rest(writer_b, "ref", 1), 40, "ref finished", interval_s=0.2)
                ok(processes, state_dir, "spawn", "rw", "--task", str(task), "--json")
                for directory, writer, name in ((state_dir, writer_a, "rw"),
                                                (other_state_dir, writer_b, "ref")):
                    wait_for(lambda w=writer, n=name: at_rest(w, n, 1), 40,  # type: ignore[misc]
                             f"{name} finished", interval_s=0.2)
                    rewind_to(processes, directory, name, 3)
                    ok(processes, directory, "start", name)
                    wait_for(lambda w=writer, n=name: at_rest(w, n, 2), 40,  # type: ignore[misc]
                             f"{name} finished again after its rewind", interval_s=0.2)
                    rewind_to(processes, directory, name, 1)
                rw_a = state_dir.agent_dir("rw") / "workspace"
                assert tree(rw_a) == {"a.txt": "1\n"}
                assert sum(1 for r in records_of(writer_a, "rw") if r[1] == "rewind") == 2
                # its bundle (the pack, with the rewinds' captures) and generations are up
                local = (packs_dir(state_dir.root) / "rw.pack").stat().st_size
                wait_for(lambda: uploaded_pack_size(fleet_cluster.urls, ha, "rw") == local,
                         20, "rw's bundle uploaded", interval_s=0.3)
                wait_for(lambda: all_uploaded(writer_a, state_dir, fleet_cluster.urls, ha, "rw"),
                         20, "rw's generations uploaded", interval_s=0.3)

                up_a.send_signal(signal.SIGKILL)  # the whole host: its children die with it
                up_a.wait(10)

                ok(processes, other_state_dir, "start", "ref")  # the uninterrupted run
                wait_for(lambda: at_rest(writer_b, "ref", 3), 40, "ref finished a third time",
                         interval_s=0.2)
                try:  # rw adopted: the rest of its last branch runs here
                    # A's two finishes adopted, then the third, here
                    wait_for(lambda: at_rest(writer_b, "rw", 3), 60,
                             "rw adopted by host B and finished there", interval_s=0.2)
                except TimeoutError:
                    log_b = other_state_dir.root / "logs" / "supervisor.log"
                    raise AssertionError(log_b.read_text()[-4000:]) from None

                def adoptions() -> list[dict[str, Any]]:  # logged once the spawn is asked
                    lines = (other_state_dir.root / "logs" / "supervisor.log").read_bytes()
                    return [r for line in lines.splitlines() if b"fleet_agent_adopted" in line
                            and (r := json.loads(line)).get("host") == ha]

                adopted = wait_for(adoptions, 20, "the adoption logged", interval_s=0.2)
                assert [(a["agent"], a["spawned"]) for a in adopted] == [("rw", True)], adopted
                count = adopted[0]["records"]
                old = dead_records(fleet_cluster.urls, ha, "rw")
                new = records_of(writer_b, "rw")
                # nothing after the second rewind on A: every record adopted, in order
                assert count == len(old) and [e for _, e, _ in new[:count]] == [
                    e for _, e, _ in old]
                seqs = {o[0]: n[0] for o, n in zip(old, new[:count], strict=True)}
                assert any(o != n for o, n in seqs.items())  # the hosts' seqs differ
                # the imported records fold on B to A's state, every seq mapped
                state_a = fold(AgentState(), branch.active(old))
                state_b = fold(AgentState(), branch.active(new[:count]))
                assert (state_b.turn, state_b.phase, state_b.tree) == (1, "running",
                                                                        state_a.tree)
                assert comparable(state_b) == comparable(state_a)
                assert state_b.session == state_a.session
                assert (state_b.last_seq, state_b.session_seq, state_b.branch) == (
                    seqs[state_a.last_seq], seqs[state_a.session_seq],
                    f"r{seqs[int(state_a.branch[1:-1])]}:")
                assert state_b.last_rewind == {**(state_a.last_rewind or {}), **{
                    k: seqs[(state_a.last_rewind or {})[k]] for k in ("seq", "to_seq",
                                                                        "from_seq")}}
                # and it ended as the uninterrupted run did: workspace and state
                rw_b = other_state_dir.agent_dir("rw") / "workspace"
                ref_b = other_state_dir.agent_dir("ref") / "workspace"
                assert tree(rw_b) == tree(ref_b) == FINAL
                final_rw = rebuild(writer_b, other_state_dir, "rw").state
                final_ref = rebuild(writer_b, other_state_dir, "ref").state
                assert final_rw == rebuild(writer_b, other_state_dir, "rw",
                                           use_generations=False).state
                assert comparable(final_rw) == comparable(final_ref)
                results = [p["call_id"] for _, e, p in branch.active(new) if e == "tool_result"]
                assert len(results) == len(set(results))  # no op twice on its branch
        finally:
            ctx.destroy(linger=0)
    finally:  # the hosts gone, the fleet forgets them (later tests' hosts adopt nothing)
        for proc in processes.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        forget_hosts(fleet_cluster.urls, [ha, hb])
