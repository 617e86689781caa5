"""With the fleet off (no `fleet.host`) no process imports any fleet code:
the fleet attaches through named hooks only (broker/hooks.py,
actors/writer/hooks.py, supervisor/runtime/hooks.py; docs/decisions.md, "Optional
parts plug in through named hooks"). Checked on the real runtime: every
interpreter it starts carries an import watch (a `sitecustomize` on
PYTHONPATH) that records each fleet module imported, with its pid."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from broker import hooks
from broker.errors import ConfigError
from broker.statedir import StateDir
from tests.processes import REPO_ROOT, ProcessTracker, wait_for
from tests.test_supervisor_process import FAST, all_running, cli, start, write_config

# what "fleet code" is: the package, and the NATS client only it uses
FLEET_PREFIXES = ("supervisor.fleet", "nats")
MAINS = ("actors.writer.process", "broker.server", "actors.procs.__main__",
         "actors.subagents.__main__", "actors.agent.__main__", "actors.zygote",
         "supervisor.cli", "supervisor.runtime.loop", "supervisor.runtime.commands")

WATCH = '''
import os, sys

_LOG = os.environ.get("CORRAL_IMPORT_WATCH")


class _FleetImports:
    """Records every fleet module a process imports (it imports it all the same)."""

    def find_spec(self, name, path=None, target=None):
        if name in {names!r} or name.startswith({prefixes!r}):
            with open(_LOG, "a") as f:
                f.write(f"{{os.getpid()}} {{name}}\\n")
        return None


if _LOG:
    sys.meta_path.insert(0, _FleetImports())
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().replace(b"\\0", b" ").decode(errors="replace")
    with open(_LOG + ".started", "a") as f:
        f.write(f"{{os.getpid()}} {{argv}}\\n")
'''


def _is_fleet(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FLEET_PREFIXES)


@pytest.mark.timeout(60)
def test_the_process_mains_import_no_fleet_module() -> None:
    """Importing every process's main (and the supervisor's runtime and CLI)
    loads nothing of the fleet."""
    code = ("import importlib, sys\n"
            f"for name in {MAINS!r}:\n"
            "    importlib.import_module(name)\n"
            f"print('\\n'.join(m for m in sys.modules if m.startswith({FLEET_PREFIXES!r})))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=50, check=True)
    loaded = [m for m in done.stdout.split() if _is_fleet(m)]
    assert loaded == []


@pytest.mark.process
@pytest.mark.timeout(150)
def test_the_runtime_with_the_fleet_off_imports_no_fleet_module(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    """supervisor, writer, broker, procs, subagents, zygote and agents run, are
    asked for their status, and stop; none of them imported a fleet module."""
    watch_dir = tmp_path / "watch"
    watch_dir.mkdir()
    prefixes = tuple(p + "." for p in FLEET_PREFIXES)
    (watch_dir / "sitecustomize.py").write_text(
        WATCH.format(names=set(FLEET_PREFIXES), prefixes=prefixes))
    log = tmp_path / "fleet-imports.log"
    env = {"CORRAL_IMPORT_WATCH": str(log),
           "PYTHONPATH": f"{watch_dir}:{REPO_ROOT}"}
    config = write_config(state_dir, agents=2, extra=[
        {"name": "procs", "kind": "procs", **FAST},
        {"name": "subagents", "kind": "subagents", **FAST}])
    proc = start(processes, state_dir, config, env=env)
    running = wait_for(lambda: all_running(processes, state_dir), 60, "every child running")
    assert set(running) == {"writer", "broker", "procs", "subagents", "agent-1", "agent-2"}
    # every child is a fork of the zygote: its hook (sitecustomize) watches them too
    for name, child in running.items():
        assert "actors.zygote" in psutil.Process(child["pid"]).cmdline(), name
    assert cli(processes, state_dir, "status", "--json").returncode == 0
    done = cli(processes, state_dir, "stop")
    assert done.returncode == 0, done.stderr
    assert proc.wait(timeout=20) == 0
    started = Path(f"{log}.started").read_text()
    # the watch was in every interpreter (the children fork from the zygote's; the
    # subagents host starts its own zygote)
    for main in ("supervisor.cli up", "actors.zygote"):
        assert f"-m {main}" in started, main
    imported = log.read_text() if log.exists() else ""
    assert imported == ""
    # and it sees a fleet import when there is one
    subprocess.run([sys.executable, "-c", "import supervisor.fleet.natsclient"],
                   env=processes.env(env), check=True, timeout=30)
    assert "supervisor.fleet.natsclient" in log.read_text()


def test_a_hook_module_adds_its_options_and_a_missing_one_is_refused() -> None:
    """`--hook MODULE` imports MODULE, which adds its own options; a module that
    cannot be imported is a configuration error naming it."""
    parser = argparse.ArgumentParser()
    hooks.add_argument(parser)
    modules = hooks.load(["--hook", "supervisor.fleet.replicate", "--fleet-host", "h1"], parser)
    args = parser.parse_args(["--hook", "supervisor.fleet.replicate", "--fleet-host", "h1"])
    assert args.fleet_host == "h1"
    assert [m.__name__ for m in modules] == ["supervisor.fleet.replicate"]
    assert len(hooks.factories(modules, "writer_hook")) == 1
    assert hooks.factories(modules, "route_hook") == []
    with pytest.raises(ConfigError, match=r"no\.such\.hook"):
        hooks.load(["--hook", "no.such.hook"], argparse.ArgumentParser())
    assert hooks.load([], argparse.ArgumentParser()) == []
