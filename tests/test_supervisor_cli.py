"""The command line's manners, without a running runtime: a closed pipe ends a
command quietly, every refused argument is one line in the CLI's words,
unknown names are errors with exit codes, `--version`/`--help` name corral,
shell completion, the warning about supervisord beside corral, and the one
dispatch of supervisor/cli/ (each module declares its commands; a run loads
only its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker.pidlock import PidLock
from broker.statedir import StateDir
from supervisor import identity
from supervisor.cli import main as cli_main
from supervisor.cli.main import main
from tests.processes import REPO_ROOT, ProcessTracker

SUBCOMMANDS = ("up", "status", "stop", "start", "restart", "remove", "reload", "kill", "logs",
               "run", "spawn", "approve", "deny", "resume", "completion", "trace")


def run_cli(state_dir: StateDir, *args: str, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args,
                           "--state-dir", str(state_dir.root)],
                          capture_output=True, text=True, timeout=30, check=False, env=env)


def piped_to_head(state_dir: StateDir, *args: str) -> subprocess.CompletedProcess[str]:
    """`supervisor ARGS | head -n 1`: stderr of the supervisor side only."""
    cmd = (f"{sys.executable} -m supervisor.cli {' '.join(args)} --state-dir {state_dir.root}"
           f" 2>{state_dir.root}/err | head -n 1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True,
                          text=True, timeout=30, check=False)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout,
                                       (state_dir.root / "err").read_text())


def _big_logs(state_dir: StateDir) -> None:
    line = json.dumps({"timestamp": "2026-01-01T00:00:00.000000Z", "level": "info",
                       "event": "filler", "pad": "x" * 200}) + "\n"
    state_dir.logs_dir.mkdir(parents=True, exist_ok=True)
    state_dir.log_path("writer").write_text(line * 5000)  # ~1.2 MB: more than a pipe holds


def test_logs_into_a_closed_pipe_ends_quietly(state_dir: StateDir) -> None:
    _big_logs(state_dir)
    done = piped_to_head(state_dir, "logs")
    assert done.stdout.count("\n") == 1
    assert done.stderr == "", done.stderr
    assert done.returncode == 0


def test_status_into_a_closed_pipe_ends_quietly(state_dir: StateDir) -> None:
    """An unanswering supervisor (the lock held, no socket): status prints the big
    status file; `| head` closes the pipe after one line."""
    child = {"kind": "agent", "pid": 1, "state": "running", "uptime_s": 1.0, "restarts": 0,
             "last_exit": None, "cpu_percent": 0.0, "rss_bytes": 1, "uss_bytes": 1,
             "heartbeat_age_s": 0.1, "values": {}}
    status = {"supervisor_pid": 1, "state_dir": str(state_dir.root), "started_at": 0.0,
              "written_at": 0.0,
              "children": [{"name": f"agent-{i}", **child} for i in range(1500)]}
    state_dir.status_path.write_text(json.dumps(status))
    lock = PidLock(state_dir.lock_path)
    lock.acquire()
    try:
        done = piped_to_head(state_dir, "status")
        assert done.stdout.count("\n") == 1
        assert done.stderr == "", done.stderr
    finally:
        lock.release()


@pytest.mark.parametrize(("args", "code", "words"), [
    (("kill", "agent-1", "--signal", "0"), 2, "0 is not a signal number (1..64)"),
    (("kill", "agent-1", "--signal", "99"), 2, "99 is not a signal number (1..64)"),
    (("kill", "agent-1", "--signal", "FOO"), 2, "unknown signal 'FOO'"),
    (("stop", "--timeout-s", "-1"), 2, "-1 must be more than 0"),
    (("status", "--bogus"), 2, "unrecognized arguments: --bogus"),
    (("stop", "bad/name"), 2, "bad/name"),
    (("spawn", "a1", "--task", "/missing.yaml"), 1, "/missing.yaml: cannot read task"),
    (("spawn", "a1", "--task", "/missing.yaml", "--model", "gpt"), 2, "unknown model 'gpt'"),
    (("logs", "--actor", "nosuch"), 1, "no log for nosuch"),
    (("logs", "--since", "yesterday"), 2, "--since 'yesterday'"),
    (("status", "agent-1"), 3, "no supervisor for"),
    (("stop", "agent-1"), 3, "no supervisor for"),
    (("trace", "bad/name"), 2, "bad/name"),
    (("trace", "a1", "--since", "0"), 2, "'0' is not a WAL seq"),
    (("trace", "nosuch"), 1, "no agent nosuch"),
])
def test_every_refusal_is_one_line_with_its_exit_code(
    state_dir: StateDir, args: tuple[str, ...], code: int, words: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _big_logs(state_dir)  # logs exist: `--actor nosuch` is refused for the name
    try:
        returned = main([*args, "--state-dir", str(state_dir.root)])
    except SystemExit as exc:  # argparse's refusals
        returned = int(exc.code or 0)
    err = capsys.readouterr().err
    assert returned == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err and "validation error" not in err


def test_version_and_help_name_corral(state_dir: StateDir, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"corral {version('corral')} ")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith(f"corral {version('corral')}")
    assert all(command in text for command in SUBCOMMANDS)


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_lists_the_subcommands(shell: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert "supervisor" in script
    missing = [c for c in SUBCOMMANDS if c not in script]
    assert not missing
    if shell == "bash":
        assert "complete " in script
    else:
        assert script.startswith("#compdef supervisor")


def test_each_command_is_declared_where_main_looks_for_it() -> None:
    """`MODULES` (supervisor/cli/main.py) names, in order, exactly the commands each
    module's `COMMANDS` declares, each with one handler; every parser is built."""
    for module, names in cli_main.MODULES:
        declared = cli_main.commands_of(module)
        assert tuple(c.name for c in declared) == names, module
        assert all((c.run is None) != (c.run_argv is None) for c in declared), module
    listed = [name for _, names in cli_main.MODULES for name in names]
    assert len(listed) == len(set(listed)) > 25
    help_text = cli_main.parser().format_help()
    assert all(f"    {name} " in help_text or f"    {name}\n" in help_text for name in listed)


def test_a_command_loads_only_its_own_module() -> None:
    """`supervisor status` imports supervisor/cli/status.py and no other command module."""
    code = ("import sys; from supervisor.cli.main import main; "
            "rc = main(['status', '--state-dir', sys.argv[1]]); "
            "print(rc, *sorted(m for m in sys.modules if m.startswith('supervisor.cli.')))")
    done = subprocess.run([sys.executable, "-c", code, str(REPO_ROOT / "no-such-state-dir")],
                          capture_output=True, text=True, timeout=60, check=True)
    rc, *loaded = done.stdout.split()
    assert rc == "3"  # no supervisor there
    commands = {module for module, _ in cli_main.MODULES}
    assert {m.removeprefix("supervisor.cli.") for m in loaded} & commands == {"status"}, loaded
    assert "supervisor.cli.main" in loaded


def _fake_supervisord(root: Path) -> Path:
    site = root / "site"
    info = site / "supervisor-4.2.5.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: supervisor\nVersion: 4.2.5\n")
    (info / "entry_points.txt").write_text(
        "[console_scripts]\nsupervisord = supervisor.supervisord:main\n")
    return site


def test_supervisord_beside_corral_is_detected(tmp_path: Path) -> None:
    assert identity.foreign_supervisor([str(tmp_path)], package_dir=tmp_path) is None
    site = _fake_supervisord(tmp_path)
    found = identity.foreign_supervisor([str(site)], package_dir=tmp_path)
    assert found is not None
    assert "supervisor 4.2.5" in found and "virtual environment" in found
    ours = tmp_path / "pkg"
    ours.mkdir()
    (ours / "supervisord.py").write_text("")
    merged = identity.foreign_supervisor([str(tmp_path / "none")], package_dir=ours)
    assert merged is not None and "supervisord.py" in merged


def test_up_warns_when_supervisord_shares_the_environment(
    processes: ProcessTracker, state_dir: StateDir, tmp_path: Path
) -> None:
    """`up` says so on start (here it then stops at once on a missing configuration)."""
    site = _fake_supervisord(tmp_path)
    env = processes.env({"PYTHONPATH": f"{REPO_ROOT}:{site}"})
    done = run_cli(state_dir, "up", "--config", str(tmp_path / "missing.yaml"), env=env)
    assert done.returncode == 78, done
    assert "supervisord is installed in the same environment" in done.stderr
    assert "python -m venv" in done.stderr
