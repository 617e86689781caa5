"""The command sandbox, tried as a hostile model would: a real agent plays
documented ops (`bash`, `bash_start`, `terminal_*`) against real writer,
broker and procs, and its commands try to read the model's key, reach the
writer's socket and forge an operator's answer, read credential files the
configuration hides (the fleet's, wherever they lie), write outside the
workspace (the host's /tmp, a parent's workspace from a subagent child),
leave a daemon behind, and use the network."""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.processes import wait_for
from tests.security.stack import MODEL_KEY, Runtime, host_pids_running, kill_pids, output_of

pytestmark = pytest.mark.process
PY = sys.executable


def test_env_inside_bash_holds_no_model_key_and_no_corral_variable(shared: Runtime) -> None:
    runtime = shared
    results = runtime.run_agent("env-1", [
        {"op": "bash", "command": "env; echo ==; tr '\\0' '\\n' </proc/1/environ; echo =="},
    ])
    out = output_of(results["1.0"])
    assert "HOME=/tmp" in out and "PATH=" in out  # env ran: the allow-listed names
    assert "OPENAI_API_KEY" not in out and MODEL_KEY not in out
    assert "CORRAL_" not in out
    # nor anywhere procs or the agent wrote: WAL, logs, the command's log
    assert runtime.files_holding(MODEL_KEY.encode()) == []


FORGE = """
import zmq
from actors.writer.client import WriterClient
from broker.statedir import StateDir
try:
    w = WriterClient(zmq.Context(), StateDir.at({root!r}), "operator", timeout_s=0.5, retries=0)
    ok = w.append("agent/victim", "approval_answer",
                  {{"request": "req-1.0", "decision": "approve", "always": True}}, key="forged-1")
    print("FORGED", ok.seq)
except Exception as exc:
    print("append-failed", type(exc).__name__)
"""


def test_a_command_cannot_reach_the_state_directory(shared: Runtime) -> None:
    runtime = shared
    root = runtime.root
    workspace = runtime.tmp / "forger-ws"
    workspace.mkdir()
    script = workspace / "forge.py"
    script.write_text(FORGE.format(root=root))
    results = runtime.run_agent("forger-1", [{"op": "bash", "command": (
        f"test -S {root}/run/writer.sock && echo writer-socket-visible || echo socket-hidden; "
        f"ls -A {root}/run 2>/dev/null | wc -l; "
        f"echo forged > {root}/agents/planted 2>/dev/null || echo write-refused; "
        f"{PY} {script}")}], workspace=workspace)
    out = output_of(results["1.0"])
    assert "socket-hidden" in out and "writer-socket-visible" not in out
    assert out.splitlines()[1].strip() == "0"  # run/ is empty: no writer, broker, supervisor socket
    assert "write-refused" in out
    assert "append-failed" in out and "FORGED" not in out  # the attempt ran, and failed
    assert list(runtime.writer.read_stream("agent/victim")) == []
    assert not (runtime.state.root / "agents" / "planted").exists()


def test_a_command_cannot_write_outside_its_workspace(shared: Runtime) -> None:
    runtime = shared
    workspace = runtime.tmp / "writer-ws"
    workspace.mkdir()
    host_tmp = Path("/tmp") / f"corral-escape-{uuid.uuid4().hex}"
    beside = runtime.tmp / "beside.txt"
    try:
        results = runtime.run_agent("escaper-1", [{"op": "bash", "command": (
            f"echo x > {host_tmp}; echo x > {beside}; echo x > /etc/corral-escape; "
            "echo private > /tmp/scratch && cat /tmp/scratch; echo inside > inside.txt")}],
            workspace=workspace)
        out = output_of(results["1.0"])
        assert "private" in out  # the sandbox's own /tmp is writable
        assert (workspace / "inside.txt").read_text() == "inside\n"
        assert not host_tmp.exists()
        assert not beside.exists()
        assert not Path("/etc/corral-escape").exists()
    finally:
        host_tmp.unlink(missing_ok=True)
        beside.unlink(missing_ok=True)
        Path("/etc/corral-escape").unlink(missing_ok=True)


def test_a_subagent_childs_command_cannot_write_its_parents_workspace(shared: Runtime) -> None:
    """A child agent is named `<parent>.<id>` and works on a copy under the
    parent's directory (actors/subagents/host.py); its commands get that copy."""
    runtime = shared
    parent_ws = runtime.tmp / "parent-ws"
    parent_ws.mkdir()
    child_ws = runtime.state.agent_dir("parent-1") / "subagents" / "s-0123456789ab" / "work"
    child_ws.mkdir(parents=True)
    results = runtime.run_agent("parent-1.s-0123456789ab", [{"op": "bash", "command": (
        f"echo pwned > {parent_ws}/pwned.txt 2>/dev/null || echo parent-refused; "
        "echo mine > mine.txt")}], workspace=child_ws)
    assert "parent-refused" in output_of(results["1.0"])
    assert not (parent_ws / "pwned.txt").exists()
    assert (child_ws / "mine.txt").read_text() == "mine\n"


def test_a_daemon_left_by_a_command_dies_with_it(shared: Runtime) -> None:
    runtime = shared
    tag = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**3}"
    forms = [f"90{tag}", f"91{tag}", f"92{tag}"]
    try:
        results = runtime.run_agent("daemon-1", [{"op": "bash", "command": (
            f"setsid sleep {forms[0]} >/dev/null 2>&1 & "
            f"(sleep {forms[1]} >/dev/null 2>&1 &) ; "
            f"env -i setsid sleep {forms[2]} >/dev/null 2>&1 & echo spawned")}])
        assert "spawned" in output_of(results["1.0"])
        assert results["1.0"]["state"] == "exited"
        for form in forms:
            wait_for(lambda form=form: not host_pids_running(["sleep", form]), 10,
                     f"the daemon `sleep {form}` to be gone")
    finally:
        for form in forms:
            kill_pids(host_pids_running(["sleep", form]))


CONNECT = ("import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); "
           "print('CONNECTED')")


def test_network_is_off_unless_the_configuration_opens_it(shared: Runtime) -> None:
    runtime = shared  # procs runs with --sandbox-network 'net-*'
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        command = f"{PY} -c \"{CONNECT.format(port=server.getsockname()[1])}\" 2>&1 " \
                  "| tail -1; echo finished"
        agents = {name: runtime.start_agent(name, [{"op": "bash", "command": command}])
                  for name in ("nonet-1", "net-1")}
        closed, opened = (runtime.finish_agent(name, agent) for name, agent in agents.items())
    assert "finished" in output_of(closed["1.0"])
    assert "CONNECTED" not in output_of(closed["1.0"])
    assert "CONNECTED" in output_of(opened["1.0"])


def test_without_bwrap_commands_are_refused_and_sandbox_off_runs_them(runtime: Runtime) -> None:
    runtime.start_procs("--bwrap", "/nonexistent/bwrap")
    refused = runtime.run_agent("agent-1", [
        {"op": "bash", "command": "echo ran > ran.txt"},
        {"op": "terminal_start", "command": "echo ran"},
    ])
    for call in ("1.0", "2.0"):
        error = output_of(refused[call])
        assert "sandbox_unavailable" in error and "bubblewrap" in error, error
    assert not (runtime.state.agent_dir("agent-1") / "workspace" / "ran.txt").exists()
    runtime.stop_procs()
    runtime.start_procs("--sandbox", "off")
    unconfined = runtime.run_agent("agent-2", [{"op": "bash", "command": "echo ran; env"}])
    out = output_of(unconfined["1.0"])
    assert out.startswith("ran") and MODEL_KEY not in out  # the environment is clean anyway
    log = runtime.state.log_path("procs").read_text()
    assert '"sandbox_off"' in log and '"warning"' in log


def test_credential_files_the_policy_hides_read_as_empty_and_cannot_be_written(
        runtime: Runtime) -> None:
    # outside /tmp (which the sandbox replaces anyway): where an operator keeps them
    keys = Path(tempfile.mkdtemp(prefix="corral-creds-", dir="/var/tmp"))
    try:
        (keys / "nats.creds").write_text("CREDS-SECRET-1\n")
        (keys / "operator.key").write_text("OPERATOR-SECRET-2\n")
        (keys / "operator.link").symlink_to(keys / "operator.key")
        (keys / "tls").mkdir()
        (keys / "tls" / "tls.key").write_text("TLS-SECRET-3\n")
        (keys / "public.pem").write_text("PUBLIC-CERT\n")  # not hidden: still readable
        # the symlink is listed, not its target: the target is what gets hidden
        runtime.start_procs("--sandbox-hide", "/run", "--sandbox-hide", str(keys / "nats.creds"),
                            "--sandbox-hide", str(keys / "operator.link"),
                            "--sandbox-hide", str(keys / "tls"))
        results = runtime.run_agent("thief-1", [{"op": "bash", "command": (
            f"cd {keys}; cat nats.creds operator.key operator.link tls/tls.key public.pem; "
            "echo entries=$(ls -A tls | wc -l); "
            "echo planted > nats.creds 2>/dev/null || echo write-refused; "
            "rm -f operator.key 2>/dev/null; test -e operator.key && echo still-there; "
            "echo done")}])
        out = output_of(results["1.0"])
        assert "PUBLIC-CERT" in out and "done" in out, out  # the command ran and could read
        for secret in ("CREDS-SECRET-1", "OPERATOR-SECRET-2", "TLS-SECRET-3"):
            assert secret not in out, out
        assert "write-refused" in out and "still-there" in out, out
        assert "entries=0" in out, out  # the hidden directory is empty
        assert (keys / "nats.creds").read_text() == "CREDS-SECRET-1\n"
        assert (keys / "operator.key").read_text() == "OPERATOR-SECRET-2\n"
    finally:
        shutil.rmtree(keys, ignore_errors=True)
