"""Each operator-facing fault of issue 32 (2 to 6), driven as a user drives it:
the `supervisor` command and the files the docs say to write, nothing else."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.acceptance.conftest import Corral, writer_task

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]

WRITER_TASK = writer_task(4, "hello hello hello hello hello {i}\\n")


@pytest.fixture(scope="module")
def running(module_corral: Corral) -> Corral:
    """One runtime on the packaged configuration for the tests that act on
    children of their own (each test uses names of its own): a foreground
    `up --quiet`, as a service manager runs it."""
    module_corral.popen("up", "--quiet", name="up-quiet")
    module_corral.wait_running(timeout_s=60)
    module_corral.write("task.yaml", WRITER_TASK)
    return module_corral


# -- fault 2 --------------------------------------------------------------------

def test_a_too_small_resume_does_not_stick_the_session(corral: Corral) -> None:
    """`resume --budget 10` (not enough) then `resume --budget 5000`: the second
    is a new grant, written and taken; the session runs to its end. The same
    request retried (`--request-id`) is written once."""
    corral.up(config=corral.config_from_default(
        {"agent": {"budget": {"tokens": 150, "cost_units": None}}}))
    corral.write("task.yaml", WRITER_TASK)
    corral.run("spawn", "n1", "--task", "task.yaml")
    corral.wait_session("n1", {"paused"})
    first = corral.run("resume", "n1", "--budget", "10", "--request-id", "r-1")
    again = corral.run("resume", "n1", "--budget", "10", "--request-id", "r-1")
    assert "+10 tokens" in first.stdout and "already recorded" in again.stdout, again
    corral.run("resume", "n1", "--budget", "5000")
    done = corral.wait_session("n1", {"finished"})
    assert done["exit_reason"] == "finished"
    trace = corral.run("trace", "n1", "--json").stdout.splitlines()
    grants = [json.loads(line)["payload"]["tokens"] for line in trace
              if json.loads(line)["event"] == "budget_resumed"]
    assert grants == [10, 5000]


# -- fault 3 --------------------------------------------------------------------

def test_fork_prints_a_command_that_runs_the_fork(running: Corral) -> None:
    corral = running
    corral.run("spawn", "src", "--task", "task.yaml")
    corral.wait_session("src", {"finished"})
    out = corral.run("fork", "src", "--name", "relf", "--at-turn", "2").stdout
    command = re.search(r"`supervisor ([^`]+)` runs it", out)
    assert command is not None, out
    last = corral.state_dir / "agents" / "relf" / "workspace" / "a3.txt"
    assert not last.exists()  # the fork stands after turn 2: a0, a1 only
    corral.run(*command.group(1).split())
    done = corral.wait_session("relf", {"finished"})
    assert done["parent_agent"] == "src"
    assert last.is_file()


# -- fault 4 --------------------------------------------------------------------

def test_wal_verify_honours_state_dir_flag_and_environment(corral: Corral) -> None:
    """`wal verify` finds the WAL by `--state-dir` and by `CORRAL_STATE_DIR`, as
    every other command does; run from a directory with no `.corral`."""
    srv = str(corral.home / "srv")
    elsewhere = corral.home / "elsewhere"
    elsewhere.mkdir()
    corral.run("up", "--detach", "--state-dir", srv, timeout_s=90)
    try:
        by_flag = corral.json("wal", "verify", "--state-dir", srv, cwd=elsewhere)
        by_env = corral.json("wal", "verify", cwd=elsewhere, env={"CORRAL_STATE_DIR": srv})
        assert by_flag["state_dir"] == by_env["state_dir"] == srv
        assert by_flag["sound"] is True and by_env["sound"] is True
        assert by_env["records"] == by_flag["records"]
        status = corral.json("status", cwd=elsewhere, env={"CORRAL_STATE_DIR": srv})
        assert status["state_dir"] == srv
    finally:
        corral.run("stop", "--state-dir", srv, rc=None)
    no_wal = corral.run("wal", "verify", cwd=elsewhere, rc=None)
    assert no_wal.returncode == 2 and str(elsewhere) in no_wal.stderr


# -- fault 5 --------------------------------------------------------------------

FAILING_PIPELINE = """\
name: breaks
inputs: []
steps:
  - {id: first, op: read_file, args: {path: no-such-file.txt}}
"""


def test_pipeline_failure_says_why_and_unknown_exits_1(running: Corral) -> None:
    corral = running
    corral.write("breaks.yaml", FAILING_PIPELINE)
    corral.run("pipeline", "check", "breaks.yaml")
    text = corral.run("pipeline", "run", "breaks.yaml", "--wait", rc=1)
    assert "failed" in text.stdout
    assert "{}" not in text.stdout and "step first" in text.stdout, text
    as_json = corral.json("pipeline", "run", "breaks.yaml", "--wait", rc=1)
    assert as_json["status"] == "failed" and as_json["error"] in text.stdout
    unknown = corral.run("pipeline", "run", "no-such-pipeline", rc=1)
    assert len(unknown.stderr.strip().splitlines()) == 1
    assert "no-such-pipeline" in unknown.stderr


# -- fault 6: paper cuts --------------------------------------------------------

def test_help_is_an_operators_page(corral: Corral) -> None:
    """`--help`: no developer notes, every command in the usage block, and the
    docs it points to exist."""
    text = corral.run("--help").stdout
    assert "parser(" not in text and "Command(" not in text
    usage = text.split("positional arguments:")[0]
    for command in ("du", "gc", "pipeline", "registry", "sessions", "fork", "wal verify"):
        assert f"supervisor {command}" in usage or f"| {command}" in usage, command
    root = ROOT
    named = set(re.findall(r"docs/[\w./-]+\.md", text))
    assert named and all((root / p).is_file() for p in named), named


def test_refusals_before_anything_runs_are_one_line(corral: Corral) -> None:
    """An invalid YAML configuration, a task file with an unknown key, and
    `status --json` with nothing up: one line each, the key named, JSON on
    stdout as `stop --json` prints it."""
    corral.write("bad.yaml", "logging:\n  level: [debug\nfoo: : bar\n")
    bad = corral.run("up", "--config", "bad.yaml", rc=78)
    assert len(bad.stderr.strip().splitlines()) == 1, bad
    assert "bad.yaml" in bad.stderr and "line 3" in bad.stderr
    corral.write("task.yaml", "name: t\nstepz: []\n")
    task = corral.run("spawn", "n1", "--task", "task.yaml", rc=1)
    assert len(task.stderr.strip().splitlines()) == 1 and "'stepz'" in task.stderr, task
    status = corral.json("status", rc=3)
    stop = corral.json("stop", rc=3)
    assert status["ok"] is False and status["error"] == stop["error"] == "no_supervisor"
    assert str(corral.state_dir) in status["detail"]


def test_a_stopped_child_and_the_control_lines(running: Corral) -> None:
    """`stop NAME`/`start NAME` say what they did; a stopped child shows no
    heartbeat and no counters; `gc --dry-run` says what its sizes mean."""
    corral = running
    assert corral.run("stop", "procs").stdout.strip() == "supervisor: stopped procs"
    row = [line for line in corral.run("status", "procs").stdout.splitlines()
           if line.startswith("procs ")]
    assert len(row) == 1 and row[0].split()[3] == "stopped", row
    assert row[0].split()[-1] == "-" and "commands=" not in row[0], row  # heartbeat, info
    assert corral.run("start", "procs").stdout.strip() == "supervisor: started procs"
    corral.wait_running(["procs"])
    dry = corral.run("gc", "--dry-run").stdout
    assert "->" not in dry and "would reclaim" in dry and "nothing was removed" in dry, dry


# -- deliverable 4: a foreground `up` shows what it does ------------------------

def test_foreground_up_says_start_progress_and_ready(corral: Corral) -> None:
    up = corral.popen("up", name="up")
    out = corral.wait(lambda: "supervisor: ready:" in corral.tracker.output("up")
                      and corral.tracker.output("up"), "the ready line", timeout_s=60)
    lines = out.splitlines()
    assert lines[0].startswith("supervisor: starting corral")
    assert any(re.fullmatch(r"supervisor: \d+ of \d+ ready", line) for line in lines), out
    ready = next(line for line in lines if line.startswith("supervisor: ready:"))
    assert re.search(r"ready: (\d+) of \1 children running;", ready), ready
    assert str(corral.state_dir) in ready
    assert f"{corral.state_dir}/run/supervisor.sock" in ready
    corral.run("stop")
    assert up.wait(timeout=30) == 0
    assert corral.tracker.output("up").splitlines()[-1] == "supervisor: stopped (exit 0)"


def test_foreground_up_quiet_says_nothing(running: Corral) -> None:
    """The module's runtime runs `up --quiet`: up and serving, it said nothing."""
    assert running.run("status").returncode == 0
    assert running.tracker.output("up-quiet") == ""
