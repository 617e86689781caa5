"""Secrets stay secret: what the model types into a terminal never comes back
out in plaintext (echoed by the tty or printed by the program), the agent's
input vault is empty once the session is over, everything corral writes under
its state directory is private (0700/0600), and the model's key reaches only
the children that call the model."""

from __future__ import annotations

import json
import signal
import stat
import time

import psutil
import pytest
import yaml

from actors.procs.redact import HOLD_S, MASK, Redactor
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for
from tests.security.stack import KEY_ENV, MODEL_KEY, Runtime, output_of

SECRET = "hunter2-sekrit-77"
# the program says where it runs (a sandbox is named corral-<proc_id>), reads a
# line (the tty echoes it), prints it back, then marks the workspace so the
# next step knows the output is all there
ECHOING = ("printf 'host:%s\\n' \"$(cat /proc/sys/kernel/hostname)\"; IFS= read -r s; "
           "printf 'got:%s\\n' \"$s\"; touch echoed.flag; sleep 30")
WAIT_FLAG = "for i in $(seq 1 400); do [ -e echoed.flag ] && exit 0; sleep 0.05; done; exit 1"


@pytest.mark.process
def test_an_echoed_terminal_secret_never_reaches_the_wal_the_logs_or_the_model(
    shared: Runtime,
) -> None:
    runtime = shared
    results = runtime.run_agent("typist-1", [
        {"op": "terminal_start", "command": ECHOING},
        {"op": "terminal_input", "proc_id": "{last_terminal}", "text": SECRET + "\n"},
        {"op": "bash", "command": WAIT_FLAG},
        {"op": "terminal_read", "proc_id": "{last_terminal}"},
        {"op": "terminal_end", "proc_id": "{last_terminal}"},
    ])
    assert results["3.0"]["exit_code"] == 0, results["3.0"]
    seen = output_of(results["4.0"])  # what the model was shown (and the WAL holds)
    assert "host:corral-t-" in seen, seen  # the terminal runs in the sandbox
    assert "got:[redacted]" in seen, seen
    assert seen.count("[redacted]") == 2  # the tty's echo and the program's print
    assert SECRET not in seen
    assert runtime.files_holding(SECRET.encode()) == []  # WAL, logs, terminal log, vault


def test_a_secret_split_over_two_reads_is_redacted() -> None:
    r = Redactor()
    r.add(b"x = 'sekrit-value'; run()\n")
    r.add(SECRET.encode() + b"\n")
    out = r.feed(b"prompt> hunter2-se") + r.feed(b"krit-77\r\nx=sek") + r.feed(b"rit-value done")
    assert out + r.flush() == b"prompt> " + MASK + b"\r\nx=" + MASK + b" done"
    # the beginning of a secret that does not go on is held only until it is clear
    assert r.feed(b"hunt") == b""
    assert r.feed(b"ing season") == b"hunting season"
    held = r.feed(b"$ hunter")  # a prompt that happens to end like a secret begins
    assert held == b"$ "
    time.sleep(HOLD_S)  # the release after silence is itself time based
    assert r.due() == b"hunter"


@pytest.mark.process
@pytest.mark.parametrize("end", ["max_turns", "restart_after_end"])
def test_the_vault_is_empty_once_the_session_is_over(shared: Runtime, end: str) -> None:
    """The session stops right after the input (closed at its turn limit):
    the typed text must not stay in the vault; and an agent restarted after
    the end empties a vault that still holds something."""
    runtime, name = shared, f"vault-{end.replace('_', '-')}"
    steps = [{"op": "terminal_start", "command": "cat"},
             {"op": "terminal_input", "proc_id": "{last_terminal}", "text": SECRET + "\n"}]
    runtime.run_agent(name, steps, max_turns=2)
    vault = runtime.state.agent_dir(name) / "vault"
    assert runtime.results(name)["2.0"]["state"] == "running"  # the input was typed
    if end == "restart_after_end":
        vault.mkdir(exist_ok=True)
        (vault / ("0" * 64)).write_text(SECRET)  # left over (a crash, an older version)
        agent = runtime.processes.spawn(["-m", "actors.agent", "--name", name,
                                         "--state-dir", runtime.root], name="again",
                                        env=dict(KEY_ENV))
        assert agent.wait(60) == 0
    assert not vault.exists() or list(vault.iterdir()) == []
    assert runtime.files_holding(SECRET.encode()) == []


@pytest.mark.process
def test_everything_under_the_state_directory_is_private(shared: Runtime) -> None:
    runtime = shared
    runtime.run_agent("modes-1", [  # default workspace: .corral/agents/modes-1/workspace
        {"op": "bash", "command": "mkdir -p out && echo data > out/file.txt"},
        {"op": "write_file", "path": "notes.md", "content": "notes"},
        {"op": "terminal_start", "command": "echo hi"},
    ])
    loose = []
    for path in [runtime.state.root, *runtime.state.root.rglob("*")]:
        mode = path.lstat().st_mode
        # directories 0700; files 0600 (0700 if executable), sockets 0700: no bit for others
        if (stat.S_ISDIR(mode) and stat.S_IMODE(mode) != 0o700) or stat.S_IMODE(mode) & 0o077:
            loose.append(f"{oct(stat.S_IMODE(mode))} {path}")
    assert loose == []
    assert (runtime.state.agent_dir("modes-1") / "workspace" / "out" / "file.txt").exists()


@pytest.mark.process
def test_the_model_key_reaches_only_children_that_call_the_model(
    processes: ProcessTracker, state_dir: StateDir,
) -> None:
    """`supervisor up` with the key in its environment: writer, broker and
    procs do not get it; an agent (through the zygote) does."""
    fast = {"backoff": {"base_s": 0.05, "cap_s": 0.2, "jitter": 0.0}, "shutdown_timeout_s": 3}
    config = state_dir.root.parent / "corral.yaml"
    config.write_text(yaml.safe_dump({
        "heartbeat": {"interval_ms": 200, "timeout_s": 5}, "status_interval_s": 0.2,
        "children": [{"name": "writer", "kind": "writer", **fast},
                     {"name": "broker", "kind": "broker", **fast},
                     {"name": "procs", "kind": "procs", **fast}],
        "agents": {"count": 1, **fast},
    }))
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(config)], name="up", env=dict(KEY_ENV))

    def pids() -> dict[str, int]:
        """Every child's pid from run/status.json once all run (rewritten every 0.2 s)."""
        try:
            children = json.loads(state_dir.status_path.read_text())["children"]
        except (OSError, ValueError, KeyError):
            return {}
        if not all(c["state"] == "running" and c["pid"] for c in children):
            return {}
        return {c["name"]: int(c["pid"]) for c in children}

    running = wait_for(pids, 30, "every child running")
    assert up.poll() is None, processes.output("up")
    environ = {name: psutil.Process(pid).environ() for name, pid in running.items()}
    assert set(environ) == {"writer", "broker", "procs", "agent-1"}
    for name in ("writer", "broker", "procs"):
        assert "OPENAI_API_KEY" not in environ[name], name
    assert environ["agent-1"].get("OPENAI_API_KEY") == MODEL_KEY
    up.send_signal(signal.SIGTERM)  # a stop: every child ends first
    assert up.wait(30) == 0
