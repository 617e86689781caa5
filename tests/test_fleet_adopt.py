"""Host loss with adoption (docs/fleet.md, "Adoption"): two corral hosts on the
real 3-node cluster; an agent of host A works through a scripted task and
waits for an approval; host A's supervisor is SIGKILLed (its children die
with it) together with the NATS node host A talks to; host B declares A
dead, fences its stream, adopts the agent (its records from A's stream, its
workspace from the newest tree in the object store) and runs it to the end:
the same workspace as an uninterrupted run of the same task on B. Host A
started again (with its node) is fenced: its writer stops with 77 at its
first publish, nothing more reaches its stream, its copy of the agent
changes nothing.

Generations (docs/fleet.md, "Generations"): the agents write a state
generation every few events and host A uploads them; the adopted agent
rebuilds on B from one (its `state_rebuilt` names a generation seq > 0, and
its state is the full fold's), while a second agent of A whose generations
were corrupted in the object store is rebuilt by the full fold and finishes
the same."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from actors.kernel.generations import SAVED_EVENT, list_generations
from actors.procs import launch
from actors.sessions.rebuild import rebuild
from actors.trees.store import packs_dir
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from supervisor.cli.agents import answer_approval
from supervisor.fleet.adopt import OBJECTS, uploaded_pack_size
from supervisor.fleet.generations import gen_object, uploaded_generations
from tests.agentkit import tree, write_task
from tests.fleetkit import (
    Cluster,
    FleetKeys,
    forget_hosts,
    operator_key_and_hosts,
    read_stream,
)
from tests.processes import ProcessTracker, wait_for
from tests.test_fleet_hosts import cli, fleet_view, host_config, other_state_dir

__all__ = ["other_state_dir"]  # the fixture, used by name

pytestmark = [pytest.mark.fleet, pytest.mark.process]

STEPS = [
    {"op": "write_file", "path": "a.txt", "content": "one\n"},
    {"op": "edit_file", "path": "a.txt", "old": "one", "new": "one+two"},
    # running when its host dies, started before the newest tree (the cut): reported lost
    {"op": "bash_start", "command": "sleep 300"},  # outlives the test: ended, not waited for
    {"op": "write_file", "path": "src/b.txt", "content": "bee"},
    {"op": "write_file", "path": "release/n.md", "content": "v1"},  # asks: the agent waits
    {"op": "bash_poll", "proc_id": "{last_command}"},  # on the adopter: reported lost
    {"op": "edit_file", "path": "a.txt", "old": "+two", "new": "+two+three"},
    {"op": "write_file", "path": "out/{i}.txt", "content": "pass {i}"},
    {"op": "finish", "summary": "done"},
]
EXPECTED = {"a.txt": "one+two+three\n", "src/b.txt": "bee", "release/n.md": "v1",
            "out/0.txt": "pass 0"}
# the second agent of host A (its generations corrupted): the same turns without the
# background command, its files' contents its own (an agent adopted alone with contents
# shared with another's: tests/test_fleet_bundle.py)
STEPS2 = [
    {"op": "write_file", "path": "a.txt", "content": "two-one\n"},
    {"op": "edit_file", "path": "a.txt", "old": "one", "new": "one+two"},
    {"op": "write_file", "path": "src/b.txt", "content": "two-bee"},
    {"op": "write_file", "path": "release/n.md", "content": "two-v1"},  # asks: it waits
    {"op": "edit_file", "path": "a.txt", "old": "+two", "new": "+two+three"},
    {"op": "write_file", "path": "out/{i}.txt", "content": "two-pass {i}"},
    {"op": "finish", "summary": "done"},
]
EXPECTED2 = {"a.txt": "two-one+two+three\n", "src/b.txt": "two-bee",
             "release/n.md": "two-v1", "out/0.txt": "two-pass 0"}


OWN_NODE = 0  # host A's NATS node, killed with it


def config_for(state_dir: StateDir, host: str, cluster: Cluster, keys: FleetKeys) -> Path:
    path = host_config(state_dir, host, cluster, keys, agents=0)
    config = yaml.safe_load(path.read_text())  # host_ttl_s 5, dead_grace_s 1: a shorter
    # TTL lets a slow status put on a loaded machine get a live host declared dead
    config["agent"] = {"approval_poll_ms": 20, "snapshot_every": 4, "permissions": {"rules": [
        {"op": "write_file", "path": "release/*", "decision": "ask"}]}}
    config["children"].append({"name": "procs", "kind": "procs"})  # the background command
    path.write_text(yaml.safe_dump(config))
    return path


def pending(writer: WriterClient, state_dir: StateDir, name: str) -> list[Any]:
    try:
        return list(rebuild(writer, state_dir, name).state.pending_approvals())
    except Exception:  # noqa: BLE001 - the writer or the stream not there yet
        return []


def generation_seqs(state_dir: StateDir, name: str) -> list[int]:
    """The seqs of the agent's generation files on this host."""
    return [int(p.name[4:24]) for p in list_generations(state_dir.agent_dir(name))]


def all_uploaded(writer: WriterClient, state_dir: StateDir, urls: list[str], host: str,
                 name: str) -> bool:
    """Every generation file of the agent is in the object store, the newest
    vouched for in its stream (read together: the agent may write one more)."""
    made = generation_seqs(state_dir, name)
    return bool(made) and uploaded_generations(urls, host, name) == made \
        and vouched(writer, name, made[-1])


def vouched(writer: WriterClient, name: str, seq: int) -> bool:
    """Whether the agent's stream holds the `generation_saved` fact of seq."""
    return any(r.event == SAVED_EVENT and isinstance(p := r.payload(), dict)
               and p.get("seq") == seq for r in writer.read_stream(f"agent/{name}"))


def corrupt_generations(urls: list[str], host: str, agent: str, seqs: list[int]) -> None:
    """Replace `host`'s generation objects of `agent` by a byte-changed copy (the
    object store's own digest is right: only the vouching fact tells)."""
    import asyncio

    import nats

    async def go() -> None:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            bucket = await nc.jetstream(timeout=5).object_store(OBJECTS)
            for seq in seqs:
                name = gen_object(host, agent, seq)
                raw = (await bucket.get(name)).data or b""
                await bucket.put(name, raw.replace(b'"phase":"', b'"phase": "', 1))
        finally:
            await nc.close()

    asyncio.run(go())


def rebuilt_lines(state_dir: StateDir, name: str) -> list[dict[str, Any]]:
    log = state_dir.root / "logs" / f"{name}.log"
    if not log.exists():
        return []
    return [r for line in log.read_bytes().splitlines()
            if (r := json.loads(line)).get("event") == "state_rebuilt"]


def finished(writer: WriterClient, name: str) -> bool:
    records = [r for r in writer.read_stream(f"agent/{name}") if r.event != SAVED_EVENT]
    return bool(records) and records[-1].event == "session_exit"


@pytest.mark.timeout(260)  # two hosts, a host loss, an adoption, a return (~35 s quiet)
def test_a_dead_hosts_agent_resumes_elsewhere_and_the_host_returns_fenced(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir, tmp_path: Path) -> None:
    fleet_cluster.wait_ready()
    key, ha, hb = operator_key_and_hosts(state_dir.root)
    node_down = False
    try:
        config_a = config_for(state_dir, ha, fleet_cluster, key)
        # host A talks to one node of the cluster, its own, which dies with it below
        data = yaml.safe_load(config_a.read_text())
        data["fleet"]["urls"] = [fleet_cluster.urls[OWN_NODE]]
        config_a.write_text(yaml.safe_dump(data))
        up_a = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                                "--config", str(config_a)], name="up-a")
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(other_state_dir.root),
                         "--config", str(config_for(other_state_dir, hb, fleet_cluster, key))],
                        name="up-b")

        seen: list[dict[str, Any]] = []

        def both_running() -> bool:
            if not (state_dir.run_dir / "fleet.json").exists():
                return False
            view = fleet_view(processes, state_dir)
            seen[:] = [view]
            return all(view.get(h) and view[h]["children"] and
                       all(c["state"] == "running" for c in view[h]["children"])
                       for h in (ha, hb))

        def described(view: dict[str, Any]) -> dict[str, Any]:
            return {h: (view.get(h, {}).get("unreadable"), view.get(h, {}).get("age_s"),
                        [(c["name"], c["state"], c.get("last_exit"))
                         for c in view.get(h, {}).get("children", [])]) for h in (ha, hb)}

        try:  # two supervisors, each a writer on the cluster, a broker with its bridge, procs
            wait_for(both_running, 90, "both hosts running", interval_s=0.3)
        except TimeoutError:
            raise AssertionError({"last seen": described(seen[0]) if seen else None,
                                  "now": described(fleet_view(processes, state_dir))}) from None
        task = write_task(tmp_path / "adopt.yaml", STEPS)
        task2 = write_task(tmp_path / "adopt2.yaml", STEPS2)
        for directory, name, task_file in ((state_dir, "victim", task),
                                           (state_dir, "victim2", task2),
                                           (other_state_dir, "ref", task)):
            done = cli(processes, directory, "spawn", name, "--task", str(task_file), "--json")
            assert done.returncode == 0, done.stdout + done.stderr + (
                directory.root / "logs" / "supervisor.log").read_text()[-3000:]

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            with WriterClient(ctx, state_dir, "probe-a") as writer_a:
                for name in ("victim", "victim2"):
                    wait_for(lambda n=name: pending(writer_a, state_dir, n), 40,  # type: ignore[misc]
                             f"host A's {name} waiting for its approval", interval_s=0.2)
                victim_a = state_dir.agent_dir("victim") / "workspace"
                before = tree(victim_a)
                assert before == {"a.txt": "one+two\n", "src/b.txt": "bee"}
                for name in ("victim", "victim2"):
                    # the newest tree's objects are in the object store (so the adoption
                    # below restores a workspace, not an empty one), and its generations,
                    # each vouched for in the stream
                    local = (packs_dir(state_dir.root) / f"{name}.pack").stat().st_size
                    wait_for(lambda n=name, size=local: uploaded_pack_size(  # type: ignore[misc]
                        fleet_cluster.urls, ha, n) == size, 20,
                        f"host A's bundle of {name} uploaded", interval_s=0.3)
                    wait_for(lambda n=name: all_uploaded(  # type: ignore[misc]
                        writer_a, state_dir, fleet_cluster.urls, ha, n), 20,
                        f"host A's generations of {name} uploaded", interval_s=0.3)
                # victim2's generations corrupted in the store: its adoption falls back
                corrupt_generations(fleet_cluster.urls, ha, "victim2",
                                    uploaded_generations(fleet_cluster.urls, ha, "victim2"))

            # the whole host goes: its supervisor SIGKILLed (its children die with it)
            # and its NATS node; the cluster goes on with two of three
            killed_at = time.monotonic()
            up_a.send_signal(signal.SIGKILL)
            fleet_cluster.kill(OWN_NODE)
            node_down = True
            up_a.wait(10)

            with WriterClient(ctx, other_state_dir, "probe-b") as writer_b:
                try:  # a stream leader on the dead node: its election comes first (~5 s idle)
                    wait_for(lambda: pending(writer_b, other_state_dir, "victim"), 90,
                             "the agent resumed on host B, waiting for its approval",
                             interval_s=0.2)
                except TimeoutError:
                    fleet_lines = [line for line in (other_state_dir.root / "logs" /
                                   "supervisor.log").read_text().splitlines() if "fleet" in line]
                    raise AssertionError("\n".join(fleet_lines[-40:])) from None
                failover_s = time.monotonic() - killed_at
                # rebuilt from a generation restored from the object store (B's seqs),
                # and the state it has is the full fold's
                [first] = wait_for(lambda: rebuilt_lines(other_state_dir, "victim"), 30,
                                   "victim's state_rebuilt on host B", interval_s=0.2)[:1]
                assert first["generation_seq"] > 0, first
                wait_for(lambda: rebuild(writer_b, other_state_dir, "victim").state == rebuild(
                    writer_b, other_state_dir, "victim", use_generations=False).state, 10,
                    "its state from the generation equal to the full fold's", interval_s=0.2)
                view = fleet_view(processes, other_state_dir)
                assert view[ha]["dead"] and view[ha]["fenced_by"] == hb
                victim_b = other_state_dir.agent_dir("victim") / "workspace"
                assert tree(victim_b) == before  # restored from the newest tree
                for name in ("victim", "victim2", "ref"):
                    wait_for(lambda n=name: pending(writer_b, other_state_dir, n), 30,  # type: ignore[misc]
                             f"{name} waiting for its approval", interval_s=0.2)
                    state = rebuild(writer_b, other_state_dir, name).state
                    [request] = state.pending_approvals()
                    answer_approval(writer_b, name, state, request.request, decision="approve",
                                    always=False, note=None)
                # victim2's corrupted generations were refused: it folded its stream
                [first2] = wait_for(lambda: rebuilt_lines(other_state_dir, "victim2"), 30,
                                    "victim2's state_rebuilt on host B", interval_s=0.2)[:1]
                assert first2["generation_seq"] == 0, first2
                for name in ("victim", "victim2", "ref"):
                    try:
                        wait_for(lambda n=name: finished(writer_b, n), 40,  # type: ignore[misc]
                                 f"{name} finished on host B", interval_s=0.2)
                    except TimeoutError:
                        log_b = other_state_dir.root / "logs" / f"{name}.log"
                        raise AssertionError(log_b.read_text()[-4000:]) from None
                events: list[tuple[str, Any]] = [
                    (r.event, r.payload()) for r in writer_b.read_stream("agent/victim")
                    if r.event != SAVED_EVENT]
                lost: list[Any] = [r.payload() for r in writer_b.read_stream("procs/victim")
                                   if r.event == "proc_lost"]
                ref_events: list[tuple[str, Any]] = [
                    (r.event, r.payload()) for r in writer_b.read_stream("agent/ref")]
            ref_b = other_state_dir.agent_dir("ref") / "workspace"
            assert tree(victim_b) == tree(ref_b) == EXPECTED
            assert tree(other_state_dir.agent_dir("victim2") / "workspace") == EXPECTED2
            refusals = [json.loads(line) for line in (other_state_dir.root / "logs" /
                        "supervisor.log").read_bytes().splitlines()
                        if b"fleet_generation_refused" in line]
            # victim's newer generations may lie past the cut; victim2's are refused
            # for their digest (the ones before the cut at least)
            assert all(r["agent"] == "victim2" or r["reason"] == "after the cut"
                       for r in refusals), refusals
            assert any(r["agent"] == "victim2" and r["reason"] ==
                       "no generation_saved fact with its digest" for r in refusals), refusals
            assert events[-1][1]["reason"] == "finished"
            results = [p["call_id"] for e, p in events if e == "tool_result"]
            assert len(results) == len(set(results))  # no op ran twice in the adopted history
            assert any(e == "workspace_tree" for e, _ in events)  # the adopted records
            # it went on with the adopted session, not a new run of the task after it
            assert [e for e, _ in events].count("session_started") == 1
            # the command it had running on host A is reported lost on host B (as procs
            # reports it after its own restart), never forgotten
            started = [p["result"]["proc_id"] for e, p in events
                       if e == "tool_result" and p["op"] == "bash_start"]
            polls = [p for e, p in events if e == "tool_result" and p["op"] == "bash_poll"]
            assert len(started) == 1 and len(polls) == 1
            assert polls[0]["result"]["proc_id"] == started[0]
            assert polls[0]["result"]["state"] == "lost"
            assert [p["proc_id"] for p in lost] == started and ha in lost[0]["reason"]
            ref_polls = [p for e, p in ref_events if e == "tool_result" and p["op"] == "bash_poll"]
            assert ref_polls[0]["result"]["state"] != "lost"  # uninterrupted: not lost
        finally:
            ctx.destroy(linger=0)

        # host A comes back, with its node: fenced, it runs nothing
        fleet_cluster.restart(OWN_NODE)
        node_down = False
        fleet_cluster.wait_ready()
        last_before = read_stream(fleet_cluster.urls, ha)[-1]
        assert "Corral-Fence" in last_before.headers
        log = state_dir.root / "logs" / "supervisor.log"
        mark = log.stat().st_size
        # the supervisor's death left victim's command running (a command outlives
        # procs by design; a machine's death would have taken it)
        assert launch.runtime_job_pids(str(state_dir.root)), "victim's sleep on host A"
        up_a2 = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                                 "--config", str(config_a)], name="up-a2")
        # its writer reads the fence when it loads its stream position (or meets it at
        # its first publish) and stops with 77, a fatal exit: the supervisor gives up
        assert up_a2.wait(60) == 69, processes.output("up-a2")[-2000:]
        restarted = [json.loads(line) for line in log.read_bytes()[mark:].splitlines()]
        assert any(r["event"] == "child_gave_up" and r.get("child") == "writer" and
                   "77" in r.get("reason", "") for r in restarted)
        # fenced, it ended what its procs had left running: the agent lives on B now
        assert any(r["event"] == "fenced_jobs_ended" and r["processes"] >= 1
                   for r in restarted), restarted[-5:]
        wait_for(lambda: not launch.runtime_job_pids(str(state_dir.root)), 10,
                 "host A's command ended")
        after = read_stream(fleet_cluster.urls, ha)
        assert after[-1].stream_seq == last_before.stream_seq  # nothing after the fence
        assert tree(victim_a) == before  # its copy of the agent changed nothing
        print(json.dumps({"host_failover_s": round(failover_s, 2)}))
    finally:  # the hosts gone, the fleet forgets them (later tests' hosts adopt nothing)
        for proc in processes.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        for root in (state_dir.root, other_state_dir.root):  # their commands with them
            launch.end_runtime_jobs(str(root))
        if node_down:  # the shared cluster whole again for the tests after this one
            fleet_cluster.restart(OWN_NODE)
            fleet_cluster.wait_ready()
        forget_hosts(fleet_cluster.urls, [ha, hb])
