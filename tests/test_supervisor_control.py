"""Per-child control, spawn and reload on a real running supervisor, through the
real CLI: `status NAME`, `stop NAME`, `start NAME`, `remove NAME`, `spawn` with
the running configuration, `reload` and SIGHUP (supervisor/runtime/requests.py,
supervisor/runtime/reload.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
from typing import Any

import psutil
import pytest
import yaml

from broker.statedir import StateDir
from supervisor.cli.main import main
from tests.processes import REPO_ROOT, ProcessTracker, wait_for
from tests.test_supervisor_process import FAST, all_running, children, start, write_config

pytestmark = pytest.mark.process
TASK = REPO_ROOT / "config" / "tasks" / "notes.yaml"


class Cli:
    """The real CLI (supervisor/cli/main.py main), run in this process against the real
    supervisor: no interpreter start per command, so the test stays short."""

    def __init__(self, state_dir: StateDir, capsys: pytest.CaptureFixture[str]) -> None:
        self.state_dir = state_dir
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main([*args, "--state-dir", str(self.state_dir.root)])
        out, err = self.capsys.readouterr()
        return code, out, err




def _pid_alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)  # several process starts; slow on a loaded host
def test_stop_start_remove_one_agent_and_status_of_one(
    processes: ProcessTracker, state_dir: StateDir, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stop NAME` holds one child down (no policy restart), the others untouched;
    `start` brings it back; `remove` drops it; unknown names and the writer are refused."""
    start(processes, state_dir, write_config(state_dir, agents=2))
    first = wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    cli = Cli(state_dir, capsys)

    code, out, err = cli("stop", "agent-1", "--json")
    assert code == 0, err
    assert json.loads(out) == {"ok": True, "command": "stop", "target": "agent-1",
                                       "affected": ["agent-1"], "state": "stopped",
                                       "last_exit": "exit 0"}
    assert not _pid_alive(first["agent-1"]["pid"])
    code, out, err = cli("status", "agent-1", "--json")
    assert code == 0, err
    shown = json.loads(out)["children"]
    assert [(c["name"], c["state"], c["pid"]) for c in shown] == [("agent-1", "stopped", None)]
    now = children(processes, state_dir)
    assert {n: c["pid"] for n, c in now.items() if n != "agent-1"} == {
        n: c["pid"] for n, c in first.items() if n != "agent-1"}
    code, out, err = cli("stop", "agent-1")
    assert code == 0 and "already stopped" in out, (out, err)

    code, out, err = cli("start", "agent-1", "--json")
    assert code == 0, err
    assert json.loads(out)["affected"] == ["agent-1"]
    back = wait_for(lambda: (c := children(processes, state_dir)["agent-1"])["state"]
                    == "running" and c, 10, "agent-1 started again")
    assert back["pid"] != first["agent-1"]["pid"]
    code, out, err = cli("start", "agent-1")
    assert code == 0 and "already running" in out, (out, err)

    code, out, err = cli("remove", "agent-2", "--json")
    assert code == 0, err
    assert json.loads(out)["affected"] == ["agent-2"]
    assert "agent-2" not in children(processes, state_dir)
    assert not _pid_alive(first["agent-2"]["pid"])

    for args, code, words in ((("stop", "nosuch"), 1, "no child named 'nosuch'"),
                              (("start", "nosuch"), 1, "no child named 'nosuch'"),
                              (("remove", "agent-2"), 1, "no child named 'agent-2'"),
                              (("status", "nosuch"), 1, "no child named nosuch"),
                              (("remove", "writer"), 1, "writer"),
                              (("stop", "broker"), 1, "broker")):
        returned, out, err = cli(*args)
        assert returned == code, (args, out, err)
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert children(processes, state_dir)["writer"]["pid"] == first["writer"]["pid"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: a connection to it is refused


@pytest.mark.timeout(120)  # several process starts; slow on a loaded host
def test_spawn_uses_the_running_configuration_and_a_refusal_changes_nothing(
    processes: ProcessTracker, state_dir: StateDir, capsys: pytest.CaptureFixture[str]
) -> None:
    """After `up --config X`, `spawn --model openai` gets X's base URL and the agent's
    failure names it; a refused spawn (name running) writes no spec."""
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    config_path = write_config(state_dir, agents=1)
    config = yaml.safe_load(config_path.read_text())
    config["agent"] = {"openai": {"base_url": url, "max_retries": 0, "timeout_s": 2}}
    config_path.write_text(yaml.safe_dump(config))
    start(processes, state_dir, config_path)
    wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    spec_dir = state_dir.config_dir / "agents"
    cli = Cli(state_dir, capsys)

    code, out, err = cli("spawn", "agent-1", "--task", str(TASK), "--json")
    assert code == 1, (out, err)
    assert "agent-1" in err and "running" in err
    assert json.loads(out)["ok"] is False
    assert not (spec_dir / "agent-1.json").exists()

    code, out, err = cli("spawn", "oa1", "--task", str(TASK), "--model", "openai")
    assert code == 0, err
    spec = json.loads((spec_dir / "oa1.json").read_text())
    assert spec["backend"] == "openai"
    assert spec["settings"]["openai"]["base_url"] == url
    log = state_dir.log_path("oa1")
    failure = wait_for(lambda: log.exists() and next(
        (line for line in log.read_text().splitlines() if "agent_loop_failed" in line), None),
        20, "the agent's model failure in its log")
    assert url in json.loads(failure)["error"]


def _pids(processes: ProcessTracker, state_dir: StateDir) -> dict[str, Any]:
    return {n: c["pid"] for n, c in children(processes, state_dir).items()}


@pytest.mark.timeout(120)  # several process starts; slow on a loaded host
def test_reload_restarts_only_what_changed_and_refuses_an_invalid_file(
    processes: ProcessTracker, state_dir: StateDir, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reload restarts only the children whose spec changed (a fatal one is started
    again), starts added ones, drops removed ones; an invalid file changes nothing."""
    procs = {"name": "procs", "kind": "procs", **FAST}
    broken = {"name": "helper", "kind": "procs", "ready_timeout_s": None,
              "intensity": {"max_restarts": 0, "period_s": 30},
              "command": ["{python}", "-c", "raise SystemExit(3)"]}
    path = write_config(state_dir, agents=2, extra=[procs, broken])
    proc = start(processes, state_dir, path)
    wait_for(lambda: (found := children(processes, state_dir))["helper"]["state"] == "fatal"
             and all(c["state"] == "running" for n, c in found.items() if n != "helper"),
             30, "every child running, the helper fatal")
    before = _pids(processes, state_dir)
    cli = Cli(state_dir, capsys)

    config = yaml.safe_load(path.read_text())
    config["children"][3]["command"] = ["{python}", "-c", "import time; time.sleep(600)"]
    config["agents"]["count"] = 3
    path.write_text(yaml.safe_dump(config))
    code, out, err = cli("reload", "--json")
    assert code == 0, err
    reply = json.loads(out)
    assert (reply["restarted"], reply["started"], reply["stopped"]) == (["helper"],
                                                                         ["agent-3"], [])
    after = wait_for(lambda: all_running(processes, state_dir), 30, "helper and agent-3 running")
    assert set(after) == {*before, "agent-3"}
    assert {n: after[n]["pid"] for n in before if n != "helper"} == {
        n: p for n, p in before.items() if n != "helper"}

    config["children"][2]["shutdown_timeout_s"] = 4  # only procs' spec changes
    config["agents"]["count"] = 1
    path.write_text(yaml.safe_dump(config))
    os.kill(proc.pid, signal.SIGHUP)  # the same reload, by signal
    wait_for(lambda: set(children(processes, state_dir)) == {"writer", "broker", "procs",
                                                              "helper", "agent-1"}, 20,
             "agent-2 and agent-3 stopped and dropped")
    kept = wait_for(lambda: all_running(processes, state_dir), 30, "procs restarted")
    assert kept["procs"]["pid"] != after["procs"]["pid"]
    kept = _pids(processes, state_dir)
    assert {n: kept[n] for n in ("writer", "broker", "helper", "agent-1")} == {
        n: after[n]["pid"] for n in ("writer", "broker", "helper", "agent-1")}
    assert proc.poll() is None

    config["agents"]["count"] = "many"
    path.write_text(yaml.safe_dump(config))
    code, out, err = cli("reload")
    assert code == 1, (out, err)
    assert str(path) in err and "agents.count" in err
    assert "integer" in err and "kept" in err
    os.kill(proc.pid, signal.SIGHUP)
    def refusals() -> list[dict[str, Any]]:
        lines = state_dir.log_path("supervisor").read_text().splitlines()
        return [json.loads(line) for line in lines if "config_reload_refused" in line]

    logged = wait_for(lambda: len(found := refusals()) >= 2 and found, 10,
                      "both refusals logged (reload, SIGHUP)")
    assert all(str(path) in r["error"] and "agents.count" in r["error"] for r in logged)
    assert _pids(processes, state_dir) == kept
    assert proc.poll() is None


@pytest.mark.timeout(120)  # several process starts; slow on a loaded host
def test_every_child_gets_the_logging_settings(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    """logging.max_bytes/backups reach every kind (writer, broker, procs, subagents, an
    agent in its own interpreter): each child's log, filled to just under max_bytes
    before the start, is rotated by that child's first lines, keeping 1 backup.
    (Agents forked by the zygote: tests/test_supervisor_commands.py.)"""
    max_bytes = 4096
    extra = [{"name": "procs", "kind": "procs", **FAST},
             {"name": "subagents", "kind": "subagents", **FAST}]
    path = write_config(state_dir, agents=1, extra=extra)
    config = yaml.safe_load(path.read_text())
    config["logging"] = {"level": "info", "max_bytes": max_bytes, "backups": 1}
    config["agents"]["zygote"] = False  # a fresh interpreter gets its settings by argv
    path.write_text(yaml.safe_dump(config))
    names = ["writer", "broker", "procs", "subagents", "agent-1"]
    state_dir.logs_dir.mkdir(parents=True, exist_ok=True)
    filler = json.dumps({"event": "filler", "level": "info", "pad": "x" * 100}) + "\n"
    for name in names:
        state_dir.log_path(name).write_text(filler * ((max_bytes - 50) // len(filler)))
        state_dir.log_path(name).with_name(f"{name}.log.1").write_text(filler)

    def unrotated() -> list[str]:  # .log.1 now holds the filler, not the single line
        return [n for n in names
                if state_dir.log_path(n).with_name(f"{n}.log.1").stat().st_size < max_bytes // 2]

    start(processes, state_dir, path)
    wait_for(lambda: all_running(processes, state_dir), 30, "every child running")
    try:
        wait_for(lambda: not unrotated(), 10, "every child's log rotated")
    except TimeoutError:
        pytest.fail(f"not rotated at max_bytes {max_bytes}: {unrotated()}")
    for name in names:
        assert state_dir.log_path(name).stat().st_size < max_bytes, name
        assert not state_dir.log_path(name).with_name(f"{name}.log.2").exists()  # backups: 1
