"""The runtime's control commands as an operator types them (docs/supervisor.md):
a foreground `supervisor up` on a copy of the packaged configuration, then
status, stop/start/restart/kill of one child, spawn and remove, reload, logs
and the metrics endpoint; last, `supervisor stop` ends the foreground `up`
with exit 0. One runtime for the module: each test acts on children of its
own (the tests run in file order, on one worker: `--dist loadfile`)."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.conftest import Corral, writer_task

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

SETTINGS: dict[str, Any] = {"agents": {"count": 3}, "metrics": {"listen": "127.0.0.1:0"}}
CORE = {"writer", "broker", "procs", "subagents"}
WRITER_TASK = writer_task(3)


@pytest.fixture(scope="module")
def runtime(module_corral: Corral) -> tuple[Corral, subprocess.Popen[bytes]]:
    corral = module_corral
    config = corral.config_from_default(SETTINGS)
    up = corral.popen("up", "--config", str(config), name="up")
    corral.wait_running(["writer", "broker", "procs", "subagents",
                         "agent-1", "agent-2", "agent-3"], timeout_s=90)
    return corral, up


def child(corral: Corral, name: str) -> dict[str, Any]:
    found: dict[str, Any] = corral.json("status", name)["children"][0]
    assert found["name"] == name
    return found


def test_foreground_up_runs_the_tree_it_configures(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, up = runtime
    status = corral.status()
    assert up.poll() is None
    assert status["supervisor_pid"] == up.pid
    assert status["state_dir"] == str(corral.state_dir)
    kids = {c["name"]: c for c in status["children"]}
    assert set(kids) == CORE | {"agent-1", "agent-2", "agent-3"}
    assert all(c["state"] == "running" and c["pid"] for c in kids.values())
    table = corral.run("status").stdout
    assert f"supervisor pid {up.pid}" in table
    assert all(name in table for name in kids)


def test_a_second_up_on_the_same_state_dir_exits_75_naming_the_holder(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, up = runtime
    held = corral.run("up", rc=75)  # systemd's Restart=on-failure stops at 75
    assert f"already supervised by pid {up.pid}" in held.stderr
    assert len(held.stderr.splitlines()) == 1
    assert corral.status()["supervisor_pid"] == up.pid


def test_status_of_named_children_and_of_an_unknown_one(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    named = corral.json("status", "writer", "agent-1")["children"]
    assert [c["name"] for c in named] == ["writer", "agent-1"]
    assert named[0]["values"]["head_seq"] >= 0
    refused = corral.run("status", "nosuch", rc=1)
    assert refused.stderr.startswith("supervisor: ") and "nosuch" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1


def test_status_watch_refreshes_until_ctrl_c(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, up = runtime
    watch = corral.popen("status", "--watch", name="watch")
    header = f"supervisor pid {up.pid}"
    corral.wait(lambda: (corral.home / "watch.out").read_text().count(header) >= 2,
                "two refreshes of status --watch")
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=30) == 0
    out = (corral.home / "watch.out").read_text()
    assert "agent-1" in out
    assert "\x1b[" not in out  # not a terminal: no screen-clearing codes in the file


def test_stop_holds_one_child_down_and_start_brings_it_back(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    reply = corral.json("stop", "agent-1")
    assert reply["ok"] is True and reply["command"] == "stop" and reply["target"] == "agent-1"
    stopped = child(corral, "agent-1")
    assert stopped["state"] == "stopped" and stopped["pid"] is None
    assert child(corral, "agent-2")["state"] == "running"
    corral.run("stop", "agent-1")  # stop of a stopped child: nothing to do, exit 0
    usage = corral.run("stop", "agent-1", "--timeout-s", "-1", rc=2)
    assert "--timeout-s" in usage.stderr and len(usage.stderr.splitlines()) == 1
    refused = corral.json("stop", "writer", rc=1)
    assert refused["ok"] is False and refused["error"]
    corral.run("start", "agent-1")
    started = corral.wait_state("agent-1", {"running"})
    assert started["pid"]
    again = corral.run("start", "agent-1")
    assert "already running" in again.stdout + again.stderr


def test_restart_replaces_the_process(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    before = child(corral, "agent-2")
    reply = corral.json("restart", "agent-2")
    assert reply["ok"] is True and reply["target"] == "agent-2"
    after = corral.wait(lambda: (c := child(corral, "agent-2"))["state"] == "running"
                        and c["pid"] != before["pid"] and c, "agent-2 restarted")
    assert after["restarts"] == before["restarts"] + 1
    corral.run("restart", "nosuch", rc=1)


def test_kill_signals_a_child_and_its_policy_restarts_it(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    before = child(corral, "agent-3")
    reply = corral.json("kill", "agent-3", "--signal", "KILL")
    assert reply["ok"] is True and reply["target"] == "agent-3"
    after = corral.wait(lambda: (c := child(corral, "agent-3"))["state"] == "running"
                        and c["pid"] != before["pid"] and c, "agent-3 restarted by policy")
    assert after["last_exit"] == "signal SIGKILL"
    assert after["restarts"] == before["restarts"] + 1
    usage = corral.run("kill", "agent-3", "--signal", "0", rc=2)
    assert usage.stderr.startswith("supervisor kill: ") and "--signal" in usage.stderr
    assert len(usage.stderr.splitlines()) == 1


def test_spawn_runs_a_task_and_remove_drops_its_spec(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    corral.write("writer.yaml", WRITER_TASK)
    out = corral.run("spawn", "w1", "--task", "writer.yaml").stdout
    assert "spawned w1" in out
    spec = corral.state_dir / "config" / "agents" / "w1.json"
    assert spec.is_file()
    session = corral.wait_session("w1", {"finished"})
    assert session["turns"] >= 3
    workspace = corral.state_dir / "agents" / "w1" / "workspace"
    assert sorted(p.name for p in workspace.iterdir()) == ["a0.txt", "a1.txt", "a2.txt"]
    assert (workspace / "a2.txt").read_text() == "pass 2\n"
    assert corral.wait_state("w1", {"exited"})["last_exit"] == "exit 0"

    in_use = corral.json("spawn", "writer", "--task", "writer.yaml", rc=1)
    assert in_use["ok"] is False
    corral.run("spawn", "w2", "--task", "missing.yaml", rc=1)
    assert corral.run("status", "w2", rc=1).returncode == 1

    reply = corral.json("remove", "w1")
    assert reply["ok"] is True
    assert "w1" not in corral.children()
    assert not spec.exists()
    trace = corral.run("trace", "w1").stdout  # the history stays
    assert "write_file OK" in trace


def test_reload_starts_what_the_file_adds_and_keeps_the_rest(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    writer_pid = child(corral, "writer")["pid"]
    corral.config_from_default({**SETTINGS, "agents": {"count": 4}})
    reply = corral.json("reload")
    assert reply["ok"] is True
    assert reply["started"] == ["agent-4"]
    assert reply["stopped"] == [] and reply["restarted"] == []
    assert reply["unchanged"] >= 7  # the core children and agents 1-3 (w1 was removed)
    corral.wait_running(["agent-4"])
    assert child(corral, "writer")["pid"] == writer_pid

    corral.config("agents: {count: many}\n")
    refused = corral.run("reload", rc=1)
    assert "corral.yaml" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1
    assert child(corral, "agent-4")["state"] == "running"


def test_logs_merge_the_actors_json_lines(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    lines = corral.run("logs", "--actor", "supervisor", "--json").stdout.splitlines()
    records = [json.loads(line) for line in lines]
    assert records and all(r["actor"] == "supervisor" for r in records)
    assert all({"timestamp", "level", "event", "pid"} <= set(r) for r in records)
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)
    assert "actor_spawned" in {r["event"] for r in records}
    merged = corral.run("logs").stdout
    assert {"writer", "broker", "supervisor"} <= {
        line.split()[1] for line in merged.splitlines() if len(line.split()) > 1}
    unknown = corral.run("logs", "--actor", "nosuch", rc=1)
    assert "nosuch" in unknown.stderr


def test_trace_and_logs_follow_an_agent_spawned_after_them(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    trace = corral.popen("trace", "-f", "t1", name="trace-f")
    logs = corral.popen("logs", "-f", name="logs-f")
    corral.wait(lambda: "no record of agent/t1 yet; waiting for it"
                in (corral.home / "trace-f.out").read_text(), "trace -f to wait for t1")
    corral.write("writer.yaml", WRITER_TASK)
    corral.run("spawn", "t1", "--task", "writer.yaml")

    def followed() -> bool:
        traced = (corral.home / "trace-f.out").read_text()
        logged = (corral.home / "logs-f.out").read_text()
        return "session exit: finished" in traced and any(
            line.split()[1:4:2] == ["t1", "session_exited"]
            for line in logged.splitlines() if len(line.split()) > 3)
    corral.wait(followed, "trace -f and logs -f to show t1's end")
    for follower in (trace, logs):  # Ctrl-C ends a follower quietly
        follower.send_signal(signal.SIGINT)
        assert follower.wait(timeout=30) == 0
    traced = (corral.home / "trace-f.out").read_text()
    assert traced.count("write_file OK") == 3
    assert "Traceback" not in traced + (corral.home / "logs-f.out").read_text()


def scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_endpoint_serves_every_child(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, _up = runtime
    port = int((corral.state_dir / "run" / "metrics.port").read_text())

    def served() -> dict[str, Any] | None:
        # the metrics are as fresh as the supervisor's last status snapshot
        families = scrape(port)
        kids = {c["name"]: c for c in corral.status()["children"]}

        def by_name(family: str) -> dict[str, float]:
            return {s.labels["name"]: s.value for s in families[family].samples
                    if s.name in (family, f"{family}_total")}  # not a counter's _created
        up, restarts = by_name("corral_child_up"), by_name("corral_child_restarts")
        head = by_name("corral_writer_head_seq")["writer"]
        matches = head == kids["writer"]["values"]["head_seq"] and all(
            up.get(name) == float(kid["state"] == "running")
            and restarts.get(name) == kid["restarts"] for name, kid in kids.items())
        return families if matches else None
    families: dict[str, Any] = corral.wait(served, "/metrics to match status")
    assert {s.labels["name"] for s in families["corral_child_up"].samples} >= CORE
    assert "corral_status_age_seconds" in families


def test_stop_ends_the_foreground_up_with_exit_0(
        runtime: tuple[Corral, subprocess.Popen[bytes]]) -> None:
    corral, up = runtime
    reply = corral.json("stop")
    assert reply["ok"] is True
    assert up.wait(timeout=60) == 0
    gone = corral.run("status", rc=3)
    assert "no supervisor" in gone.stderr
