"""One view of a fleet (docs/fleet.md): two corral hosts (each its own state
directory and `supervisor up` in fleet mode) on a real 3-node JetStream
fleet_cluster. `status --fleet` shows every host and its children, a silent host is
marked stale with its age; `supervisor kill HOST:AGENT` reaches the other host
through NATS request/reply, signed by the fleet operator, and a request not so
signed is refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from actors.writer.client import WriterClient
from broker.statedir import StateDir
from supervisor.console import views as console_views
from supervisor.fleet import ctl, operatorsig
from supervisor.fleet.natsclient import control_subject
from supervisor.fleet.place import PLACE_HOST, PLACE_SUBJECT, place_subject
from tests.agentkit import write_task
from tests.fleetkit import (
    Cluster,
    FleetKeys,
    forget_hosts,
    make_keys,
    operator_key_and_hosts,
    read_stream,
    stream_records,
)
from tests.processes import ProcessTracker, wait_for

pytestmark = [pytest.mark.fleet, pytest.mark.process]

FAST = {"backoff": {"base_s": 0.05, "cap_s": 0.2, "jitter": 0.0},
        "intensity": {"max_restarts": 5, "period_s": 30}, "shutdown_timeout_s": 3}


@pytest.fixture
def other_state_dir() -> Iterator[StateDir]:
    root = Path(tempfile.mkdtemp(prefix="corral-", dir="/tmp"))
    try:
        yield StateDir(root / ".corral").ensure()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def host_config(state_dir: StateDir, host: str, fleet_cluster: Cluster, keys: FleetKeys,
                agents: int = 1) -> Path:
    config = {
        "heartbeat": {"interval_ms": 200, "timeout_s": 5},
        "status_interval_s": 0.3,
        "broker": {"heartbeat_interval_ms": 200, "heartbeat_misses": 5},
        "children": [
            {"name": "writer", "kind": "writer", "fatal_exit_codes": [65, 77, 78], **FAST},
            {"name": "broker", "kind": "broker", **FAST},
        ],
        "agents": {"count": agents, **FAST},
        "fleet": {"host": host, "urls": fleet_cluster.urls,
                  "operator_public_key": str(keys.public), "bus_secret": str(keys.bus_secret),
                  "host_ttl_s": 5.0, "dead_grace_s": 1.0},
    }
    path = state_dir.root.parent / "corral-fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(processes: ProcessTracker, state_dir: StateDir,
        *args: str, keys: FleetKeys | None = None) -> subprocess.CompletedProcess[str]:
    """The command line; with `keys`, as the operator (CORRAL_OPERATOR_KEY set)."""
    env = processes.env() if keys is None else keys.env(processes.env())
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args, "--state-dir", str(state_dir.root)],
        env=env, capture_output=True, text=True, timeout=30, check=False)


def fleet_view_cli(processes: ProcessTracker, state_dir: StateDir) -> dict[str, dict[str, Any]]:
    done = cli(processes, state_dir, "status", "--fleet", "--json")
    assert done.returncode == 0, done.stderr
    return {h["host"]: h for h in json.loads(done.stdout)["hosts"]}


def fleet_view(_processes: ProcessTracker, state_dir: StateDir,
               patience_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """The same view, asked in this process (the polls need no interpreter each).
    A cluster that did not answer in time is asked again, as an operator would
    run the command again, for up to `patience_s`; then ClusterSilentError.
    (nats-py's timeout is a TimeoutError: raised as it is, it read as the
    deadline of the caller's `wait_for` and was reported as hosts that never
    came up, lost in CI on a loaded machine.)"""
    config = ctl.fleet_config(state_dir, None)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return {h["host"]: h for h in ctl.fleet_status(config)}
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise ClusterSilentError(f"the cluster did not answer a status read for "
                                         f"{patience_s:g}s: {exc!r}") from exc
            time.sleep(0.2)


def storage_fleet(state_dir: StateDir) -> dict[str, Any] | None:
    """The console's Storage page's fleet part, once it lists both hosts' agents."""
    fleet = console_views.storage_usage(state_dir, None)["fleet"]
    if fleet is None or fleet["error"] is not None or len(fleet["hosts"]) < 2:
        return None
    if not any(h["agents"] for h in fleet["hosts"]):
        return None
    return {"error": fleet["error"], "hosts": {h["host"]: h for h in fleet["hosts"]}}


class ClusterSilentError(RuntimeError):
    """The test's status reads got no answer from the cluster (not a TimeoutError:
    callers take that one for their own deadline)."""


def child(host: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in host["children"] if c["name"] == name)


@pytest.mark.timeout(150)  # two hosts, a host loss and its return (~30 s on a quiet machine)
def test_fleet_status_and_control_across_hosts(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir) -> None:
    fleet_cluster.wait_ready()
    keys, ha, hb = operator_key_and_hosts(state_dir.root)
    try:
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                         "--config", str(host_config(state_dir, ha, fleet_cluster, keys, 1))],
                        name="up-a")
        up_b = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir",
                                str(other_state_dir.root), "--config",
                                str(host_config(other_state_dir, hb, fleet_cluster, keys,
                                                agents=0))],
                               name="up-b")

        def both_running() -> dict[str, dict[str, Any]] | None:
            view = fleet_view(processes, state_dir) if (state_dir.run_dir / "fleet.json").exists() \
                else {}
            hosts = [view.get(ha), view.get(hb)]
            if all(h is not None and h["children"] and
                   all(c["state"] == "running" for c in h["children"]) for h in hosts):
                return view
            return None

        wait_for(both_running, 40, "both hosts running in the fleet view", interval_s=0.3)

        def cli_shows_both() -> dict[str, dict[str, Any]] | None:
            view = fleet_view_cli(processes, state_dir)  # the real command
            names = [{c["name"] for c in view.get(h, {}).get("children", [])} for h in (ha, hb)]
            return view if names == [{"writer", "broker", "agent-1"}, {"writer", "broker"}] \
                else None

        # another read, maybe of a replica a put behind the one the wait above read
        view = wait_for(cli_shows_both, 30, "both hosts' children in `status --fleet`",
                        interval_s=0.3)
        assert not view[ha]["stale"] and not view[hb]["stale"]
        # the console's Storage page shows the same hosts and where each agent runs
        shown = wait_for(lambda: storage_fleet(state_dir), 30, "the console's fleet view",
                         interval_s=0.3)
        assert shown["error"] is None
        assert shown["hosts"][ha]["agents"] == ["agent-1"] and shown["hosts"][hb]["agents"] == []
        assert not shown["hosts"][ha]["dead"] and not shown["hosts"][hb]["dead"]
        restarts = child(view[hb], "broker")["restarts"]

        # host A's operator kills a child of host B; B's supervisor restarts it
        done = cli(processes, state_dir, "kill", f"{hb}:broker", "--json", keys=keys)
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)["ok"] is True
        wait_for(lambda: child(fleet_view(processes, state_dir)[hb], "broker")["restarts"]
                 > restarts, 20, "host B's broker restarted", interval_s=0.3)

        # a request not signed with the operator's key is refused by host B
        other = operatorsig.load_private(make_keys(state_dir.root.parent / "other").operator)
        forged = asyncio.run(_request(fleet_cluster.urls, control_subject(hb),
                                      ctl.sign(other, "stop", hb, "agent-1")))
        assert forged["ok"] is False and forged["error"] == "forbidden"
        # a replayed (validly signed) request is refused too
        operator = operatorsig.load_private(keys.operator)
        signed = ctl.sign(operator, "kill", hb, "nobody")
        first = asyncio.run(_request(fleet_cluster.urls, control_subject(hb), signed))
        assert first["ok"] is False and first["error"] != "forbidden"  # no such child
        again = asyncio.run(_request(fleet_cluster.urls, control_subject(hb), signed))
        assert again["ok"] is False and again["error"] == "forbidden"

        # host B's writer replicates its WAL to its own stream, not host A's
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            client = WriterClient(ctx, other_state_dir, "t1")
            seq = client.append("agent/t1", "turn", {"n": 1}, key="on-b").seq
            client.close()
        finally:
            ctx.destroy(linger=0)
        assert json.loads(stream_records(fleet_cluster.urls, hb)[seq])["key"] == "on-b"
        assert all(json.loads(line)["key"] != "on-b"
                   for line in stream_records(fleet_cluster.urls, ha).values())

        # placement: host A runs an agent, host B none: `--host auto` lands on B, through
        # the hosts' queue group (A declines it if NATS hands it to A first, naming B)
        task = write_task(state_dir.root.parent / "placed.yaml",
                          [{"op": "finish", "summary": "done"}])
        declined = asyncio.run(_request(fleet_cluster.urls, place_subject(ha), ctl.sign(
            operator, "spawn", PLACE_HOST, "x", task=task.read_text())))
        assert (declined["ok"], declined["error"], declined["host"]) == (False, "declined", ha)
        # B, unless the view could not read B's entry (under load): declined all the same
        assert declined["least"] == hb or declined["detail"].startswith("the view could not"), \
            declined
        done = cli(processes, state_dir, "spawn", "placed", "--task", str(task), "--host", "auto",
                   "--json", keys=keys)
        assert done.returncode == 0, done.stdout + done.stderr
        placed = json.loads(done.stdout)
        assert placed["host"] == hb and placed.get("placed") is True, placed
        # the queue group takes only a spawn signed for `auto` with the operator key
        for forged in (ctl.sign(other, "spawn", PLACE_HOST, "x", task="steps: []"),
                       ctl.sign(operator, "spawn", hb, "x", task="steps: []"),
                       ctl.sign(operator, "kill", PLACE_HOST, "agent-1")):
            refused = asyncio.run(_request(fleet_cluster.urls, PLACE_SUBJECT, forged))
            assert refused["ok"] is False and refused["error"] == "forbidden", refused
        # ... and a host's own subject never takes one signed for `auto`
        refused = asyncio.run(_request(fleet_cluster.urls, control_subject(hb), ctl.sign(
            operator, "spawn", PLACE_HOST, "x", task="steps: []")))
        assert refused["ok"] is False and refused["error"] == "forbidden", refused
        wait_for(lambda: "placed" in {c["name"] for c in fleet_view(processes, state_dir)[hb][
            "children"]}, 20, "the placed agent in host B's status", interval_s=0.3)
        assert "placed" not in {c["name"] for c in fleet_view(processes, state_dir)[ha]["children"]}

        # host B's supervisor SIGKILLed: its entry goes stale, with its age
        up_b.send_signal(signal.SIGKILL)
        up_b.wait(10)
        # one read per poll: the entry is read from any replica of the bucket (direct get),
        # so two reads in a row may see two different entries of a silent host
        def host_b_if(flag: str) -> dict[str, Any] | None:
            entry = fleet_view(processes, state_dir).get(hb, {})
            return entry if entry.get(flag) and not entry.get("unreadable") else None

        stale = wait_for(lambda: host_b_if("stale"), 20, "host B marked stale", interval_s=0.2)
        # stale: older than half the TTL (5 s); age_s is rounded to a tenth
        assert stale.get("dead") or stale.get("expired") or stale["age_s"] >= 2.5
        # its entry expires; after the grace host A declares it dead and fences its stream
        dead = wait_for(lambda: host_b_if("dead"), 30, "host B declared dead", interval_s=0.3)
        assert dead["fenced_by"] == ha
        # the table is another read, maybe of a replica that has yet to see the fence
        def table_shows_it() -> bool:
            text = cli(processes, state_dir, "status", "--fleet")
            return text.returncode == 0 and f"DEAD (fenced by {ha}" in text.stdout

        wait_for(table_shows_it, 30, "the status table showing host B dead", interval_s=0.3)
        # B's stream ends with A's fence: a writer of B that comes back meets it at its
        # first publish and stops (test_fleet_wal.py: test_a_fenced_host_...)
        fence = read_stream(fleet_cluster.urls, hb)[-1]
        assert fence.headers["Corral-Fence"].startswith(f"by {ha} ")

    finally:  # the hosts gone, the fleet forgets them: a later test's host would
        # otherwise fence them and adopt their agents ("placed")
        for proc in processes.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        forget_hosts(fleet_cluster.urls, [ha, hb])

async def _request(urls: list[str], subject: str, data: bytes) -> dict[str, Any]:
    import nats

    nc = await nats.connect(urls)
    try:
        msg = await nc.request(subject, data, timeout=10)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply
    finally:
        await nc.close()
