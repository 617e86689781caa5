"""The supervisor as real processes: `supervisor up` started as an OS process,
driven through the real CLI, with short intervals from a test configuration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process

FAST = {"backoff": {"base_s": 0.05, "cap_s": 0.2, "jitter": 0.0},
        "intensity": {"max_restarts": 5, "period_s": 30}, "shutdown_timeout_s": 3}


def write_config(state_dir: StateDir, *, agents: int = 2,
                 extra: list[dict[str, Any]] | None = None,
                 writer: dict[str, Any] | None = None) -> Path:
    config = {
        "heartbeat": {"interval_ms": 200, "timeout_s": 5},
        "status_interval_s": 0.2,
        "broker": {"heartbeat_interval_ms": 200, "heartbeat_misses": 5},
        "children": [
            {"name": "writer", "kind": "writer", "fatal_exit_codes": [65, 78], **FAST,
             **(writer or {})},
            {"name": "broker", "kind": "broker", **FAST},
            *(extra or []),
        ],
        "agents": {"count": agents, **FAST},
    }
    path = state_dir.root.parent / "corral-test.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(processes: ProcessTracker, state_dir: StateDir, *args: str,
        timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args, "--state-dir", str(state_dir.root)],
        env=processes.env(), capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def status(processes: ProcessTracker, state_dir: StateDir) -> dict[str, Any]:
    done = cli(processes, state_dir, "status", "--json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def children(_processes: ProcessTracker, state_dir: StateDir) -> dict[str, dict[str, Any]]:
    """Every child's status, asked in this process (the polls of a wait need no CLI
    interpreter each; `status()` runs the real command)."""
    from broker import protocol
    from supervisor import client

    reply = client.ask(state_dir, protocol.StatusRequest(msg_id="test-status"), timeout_s=5.0)
    assert isinstance(reply, protocol.StatusReply)
    return {c.name: c.model_dump(mode="json") for c in reply.children}


def start(processes: ProcessTracker, state_dir: StateDir, config: Path,
          name: str = "up", env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                            "--config", str(config)], name=name, env=env)
    wait_for(lambda: state_dir.status_path.exists() or proc.poll() is not None, 20,
             "the supervisor's first status file")
    assert proc.poll() is None, processes.output(name)
    return proc


def all_running(processes: ProcessTracker, state_dir: StateDir) -> dict[str, dict[str, Any]]:
    found = children(processes, state_dir)
    return found if all(c["state"] == "running" for c in found.values()) else {}


@pytest.mark.timeout(150)  # about twelve interpreters: 17 s at load ~5, far more at ~10
def test_up_status_kill_restart_and_stop(processes: ProcessTracker, state_dir: StateDir) -> None:
    """Every kind is restarted after a kill and counted; restart works; stop leaves nothing."""
    proc = start(processes, state_dir, write_config(state_dir))
    first = wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    assert set(first) == {"writer", "broker", "agent-1", "agent-2"}
    wait_for(lambda: all(c["pid"] and c["uss_bytes"] is not None
                         for c in children(processes, state_dir).values()), 20, "samples")

    for name, sig in (("writer", "KILL"), ("broker", "TERM"), ("agent-1", "KILL")):
        done = cli(processes, state_dir, "kill", name, "--signal", sig)
        assert done.returncode == 0, done.stderr

        def restarted(name: str = name) -> bool:
            c = children(processes, state_dir)[name]
            return c["state"] == "running" and c["pid"] != first[name]["pid"]

        wait_for(restarted, 15, f"{name} restarted")
        assert children(processes, state_dir)[name]["restarts"] == 1

    done = cli(processes, state_dir, "restart", "agent-2")
    assert done.returncode == 0, done.stderr
    wait_for(lambda: children(processes, state_dir)["agent-2"]["pid"] != first["agent-2"]["pid"]
             and children(processes, state_dir)["agent-2"]["state"] == "running", 10,
             "agent-2 restarted on request")

    assert cli(processes, state_dir, "kill", "nobody").returncode == 1
    pids = [c["pid"] for c in children(processes, state_dir).values()]
    done = cli(processes, state_dir, "stop")
    assert done.returncode == 0, done.stderr
    assert proc.wait(timeout=10) == 0
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert processes.marked() == []


def test_crash_loop_backs_off_then_is_fatal_while_status_answers(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    """A child that exits at once every time backs off, gives up; status keeps answering."""
    crasher = {"name": "procs", "kind": "procs", "ready_timeout_s": None,
               "command": ["{python}", "-c", "import sys; sys.exit(3)"],
               "backoff": {"base_s": 0.1, "cap_s": 0.4, "jitter": 0.0},
               "intensity": {"max_restarts": 4, "period_s": 30}}
    proc = start(processes, state_dir, write_config(state_dir, agents=1, extra=[crasher]))
    wait_for(lambda: children(processes, state_dir)["procs"]["state"] == "fatal", 20,
             "the crash-looping child marked fatal")
    final = children(processes, state_dir)
    assert final["procs"]["restarts"] == 4
    assert final["procs"]["last_exit"] == "exit 3"
    # the rest of the runtime goes on; agents start after a given-up procs child
    wait_for(lambda: children(processes, state_dir)["agent-1"]["state"] == "running", 10,
             "agents running after procs gave up")
    cpu = psutil.Process(proc.pid).cpu_times()
    assert cpu.user + cpu.system < 3.0
    log = (state_dir.logs_dir / "supervisor.log").read_text()
    assert '"child_gave_up"' in log
    # the first restart is immediate, each one after it backs off (read from the
    # log, not from a transient state that polling may miss)
    assert log.count('"child_backed_off"') == 3


def test_sigkill_of_the_supervisor_leaves_no_child(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    """Children and grandchildren (zygote-forked agents) die with the supervisor."""
    proc = start(processes, state_dir, write_config(state_dir, agents=3))
    wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 6  # writer, broker, zygote, 3 agents
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)

    def alive(p: psutil.Process) -> bool:
        try:  # a process may end between the two questions: that is what we wait for
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def all_gone() -> bool:
        return not [p for p in tree if alive(p)]

    # PDEATHSIG is immediate, but a dying process's exit waits for a CPU on a busy machine
    wait_for(all_gone, 10.0, "every descendant gone")


def test_second_up_is_refused_naming_the_holder(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    config = write_config(state_dir, agents=0)
    proc = start(processes, state_dir, config)
    done = cli(processes, state_dir, "up", "--config", str(config))
    assert done.returncode == 75
    assert f"pid {proc.pid}" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_status_without_supervisor_exits_3(processes: ProcessTracker, state_dir: StateDir) -> None:
    done = cli(processes, state_dir, "status")
    assert done.returncode == 3
    assert done.stderr.strip() == f"supervisor: no supervisor for {state_dir.root}"


def test_invalid_config_is_refused_naming_the_key(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    bad = state_dir.root.parent / "bad.yaml"
    bad.write_text("children:\n  - {name: writer, kind: writer, restart: sometimes}\n")
    done = cli(processes, state_dir, "up", "--config", str(bad))
    assert done.returncode == 78
    assert str(bad) in done.stderr
    assert "children.0.restart" in done.stderr


def test_unanswered_status_falls_back_to_the_stale_file(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    proc = start(processes, state_dir, write_config(state_dir, agents=0))
    wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        done = cli(processes, state_dir, "status", "--json")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert done.returncode == 4, done.stderr
    data = json.loads(done.stdout)
    assert data["stale"] is True
    assert data["stale_age_s"] >= 0.9
    assert {c["name"] for c in data["children"]} == {"writer", "broker"}


def test_writer_wal_corruption_stops_the_runtime_with_65(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    """Exit 65 from the writer is fatal at once; nothing runs without it."""
    corrupt = {"command": ["{python}", "-c", "import sys; sys.exit(65)"], "ready_timeout_s": 5}
    proc = processes.spawn(
        ["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root), "--config",
         str(write_config(state_dir, agents=1, writer=corrupt))], name="up")
    assert proc.wait(timeout=20) == 65
    assert "WAL corrupt" in processes.output("up")
    data = json.loads(state_dir.status_path.read_text())
    states = {c["name"]: c["state"] for c in data["children"]}
    assert states["writer"] == "fatal"
    assert states["broker"] != "running"


# Warnings an idle agent logs legitimately on a loaded machine: a broker stalled
# past heartbeat_interval_ms x heartbeat_misses (1 s here) makes the agent's peer
# reconnect (broker/peer.py). Any other warning is a fault.
LOAD_WARNINGS = frozenset({"broker_reconnected"})


def test_logs_merge_actors_in_time_order(processes: ProcessTracker, state_dir: StateDir) -> None:
    proc = start(processes, state_dir, write_config(state_dir, agents=1))
    wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    assert cli(processes, state_dir, "stop").returncode == 0
    proc.wait(timeout=10)
    done = cli(processes, state_dir, "logs", "--json")
    records = [json.loads(line) for line in done.stdout.splitlines()]
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)
    assert {"supervisor", "writer", "broker", "agent-1"} <= {r["actor"] for r in records}
    errors = cli(processes, state_dir, "logs", "--actor", "agent-1", "--level", "warning",
                 "--json")
    assert errors.returncode == 0, errors.stderr
    warned = [json.loads(line) for line in errors.stdout.splitlines()]
    assert all(r["actor"] == "agent-1"
               and str(r["level"]).lower() in ("warning", "error", "critical")
               for r in warned), warned
    # agent-1 warns of nothing but what load alone can cause
    assert [r for r in warned if r["event"] not in LOAD_WARNINGS] == []
    since = cli(processes, state_dir, "logs", "--since", "1h", "--actor", "supervisor")
    assert "supervisor_stopped" in since.stdout


def _zygote_of(state_dir: StateDir) -> psutil.Process:
    """The supervisor's zygote, by the pid its log gives (its forks, agents and
    the pool's members, show the same argv)."""
    lines = [json.loads(line) for line in state_dir.log_path("supervisor").read_text()
             .splitlines() if '"zygote_spawned"' in line]
    return psutil.Process(int(lines[-1]["pid"]))


@pytest.mark.timeout(150)  # 16-17 s at load ~5, far more at ~10
@pytest.mark.parametrize("use_zygote", [True, False], ids=["zygote", "no-zygote"])
def test_writer_and_broker_start_and_restart_forked_from_the_zygote_or_fresh_without_it(
    processes: ProcessTracker, state_dir: StateDir, use_zygote: bool,
) -> None:
    """The writer and broker first start as forks of the zygote (their argv is
    the zygote's: no fresh interpreter, no imports), and a killed one comes back
    as a fork of it and serves: status shows it running (it said ready) and an
    agent's appends go on. Without the zygote they start and come back as fresh
    interpreters. Either way their environment holds no model key (the
    zygote's does)."""
    config = write_config(state_dir, agents=1)
    if not use_zygote:
        data = yaml.safe_load(config.read_text())
        data["agents"]["zygote"] = False
        config.write_text(yaml.safe_dump(data))
    proc = start(processes, state_dir, config, env={"OPENAI_API_KEY": "sk-test-not-for-writers"})
    first = wait_for(lambda: all_running(processes, state_dir), 40, "every child running")
    template = _zygote_of(state_dir) if use_zygote else None
    for name in ("writer", "broker"):
        first_argv = psutil.Process(first[name]["pid"]).cmdline()
        if template is not None:
            assert first_argv == template.cmdline()  # the first start is a fork too
        else:
            assert first_argv[1:3] == ["-m", "actors.writer" if name == "writer"
                                       else "broker.server"]
        assert "OPENAI_API_KEY" not in psutil.Process(first[name]["pid"]).environ()
    for name, sig in (("writer", "KILL"), ("broker", "KILL")):
        done = cli(processes, state_dir, "kill", name, "--signal", sig)
        assert done.returncode == 0, done.stderr

        def restarted(name: str = name) -> dict[str, Any] | None:
            c = children(processes, state_dir)[name]
            ok = c["state"] == "running" and c["pid"] != first[name]["pid"]
            return c if ok else None

        child = wait_for(restarted, 15, f"{name} restarted")
        argv = psutil.Process(child["pid"]).cmdline()
        if template is not None:
            assert argv == template.cmdline()  # forked from the template, never exec'd
        else:
            module = "actors.writer" if name == "writer" else "broker.server"
            assert argv[1:3] == ["-m", module]
        assert "OPENAI_API_KEY" not in psutil.Process(child["pid"]).environ()
    # the restarted writer takes appends: the agent's heartbeats and the writer's
    # own ready are not enough, so ping it through its socket
    import zmq

    from actors.writer.client import WriterClient

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, state_dir, "test", timeout_s=2) as writer:
            ok = writer.append("test/zygote", "probe", {"n": 1}, key="probe-1")
            assert ok.seq >= 1 and not ok.duplicate
    finally:
        ctx.destroy(linger=0)
    done = cli(processes, state_dir, "stop")
    assert done.returncode == 0, done.stderr
    assert proc.wait(timeout=10) == 0
    assert processes.marked() == []
