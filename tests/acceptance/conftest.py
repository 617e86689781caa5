"""The acceptance harness: corral driven only as a user drives it.

A test gets a `Corral` (the `corral` fixture): a fresh home directory, the
`supervisor` command run as a subprocess in it, and helpers to write the
files the docs tell users to write (configuration, task files). Nothing here
imports corral's modules or writes into `.corral/` by hand
(tests/acceptance/test_user_only.py checks that). At teardown the runtime is
stopped with `supervisor stop`, and any process left with the test's marker
fails the test (tests/processes.py). `module_corral` is the same home shared
by a module's tests (one runtime per module where tests only read, or act on
children of their own)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.processes import ProcessTracker, wait_for

SUPERVISOR = str(Path(sys.executable).with_name("supervisor"))
pytestmark = pytest.mark.process
# docs/operations.md: "Start your own configuration from the default one"
DEFAULT_CONFIG_COMMAND = ("from supervisor.config import DEFAULT_CONFIG_PATH as p; print(p)")
_default_config_text: list[str] = []


def default_config_text() -> str:
    """The packaged configuration, found the way docs/operations.md says."""
    if not _default_config_text:
        path = subprocess.run([sys.executable, "-c", DEFAULT_CONFIG_COMMAND], check=True,
                              capture_output=True, text=True, timeout=60).stdout.strip()
        _default_config_text.append(Path(path).read_text())
    return _default_config_text[0]


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def writer_task(repeat: int, content: str = "pass {i}\\n") -> str:
    """A scripted task file (docs/agents.md) that writes a{i}.txt `repeat` times."""
    return ("name: writer\nprompt: write a few files\n"
            f"repeat: {repeat}\nsteps:\n"
            f'  - {{op: write_file, path: "a{{i}}.txt", content: "{content}"}}\n')


@dataclass(frozen=True)
class Result:
    """One finished `supervisor` command."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def __str__(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode}\n"
                f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}")


class CommandFailedError(AssertionError):
    pass


class Corral:
    """A user's home for one test: `run()` is typing `supervisor ...` there."""

    def __init__(self, home: Path, tracker: ProcessTracker) -> None:
        self.home = home
        self.tracker = tracker
        self.state_dir = home / ".corral"
        self.env_extra: dict[str, str] = {}

    # -- running the command -------------------------------------------------
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = self.tracker.env()
        env.pop("CORRAL_STATE_DIR", None)
        env["COLUMNS"] = "200"
        env.update(self.env_extra)
        if extra:
            env.update(extra)
        return env

    def run(self, *args: str, rc: int | None = 0, timeout_s: float = 60.0,
            input: str | None = None, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Result:
        """Run `supervisor args...`; check the exit code unless `rc` is None."""
        argv = [SUPERVISOR, *args]
        done = subprocess.run(
            argv, check=False, cwd=cwd or self.home, env=self.env(env), input=input,
            capture_output=True, text=True, timeout=timeout_s,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        result = Result(argv, done.returncode, done.stdout, done.stderr)
        if rc is not None and done.returncode != rc:
            raise CommandFailedError(f"expected exit {rc}\n{result}")
        return result

    def json(self, *args: str, rc: int | None = 0, **kwargs: Any) -> Any:
        result = self.run(*args, "--json", rc=rc, **kwargs)
        try:
            return result.json()
        except json.JSONDecodeError as exc:
            raise CommandFailedError(f"not JSON: {exc}\n{result}") from None

    def popen(self, *args: str, name: str,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start a long-running `supervisor args...` (output in its log file)."""
        return self.tracker.spawn([SUPERVISOR, *args], name=name, python=False,
                                  env={**self.env_extra, **(env or {})}, cwd=self.home)

    # -- the files a user writes ---------------------------------------------
    def write(self, relpath: str, text: str) -> Path:
        path = self.home / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def config(self, text: str = "", name: str = "corral.yaml") -> Path:
        """A configuration file with exactly `text` (a whole configuration: `up`
        refuses one without its children; config_from_default starts from the
        packaged file, as docs/operations.md says)."""
        return self.write(name, text)

    def config_from_default(self, changes: Mapping[str, Any],
                            name: str = "corral.yaml") -> Path:
        """A copy of the packaged configuration with `changes` (nested keys) made."""
        data = _merge(yaml.safe_load(default_config_text()), changes)
        return self.write(name, yaml.safe_dump(data, sort_keys=False))

    # -- the runtime ---------------------------------------------------------
    def up(self, *extra: str, config: Path | None = None, agents: int = 0) -> None:
        """`supervisor up --detach`, then wait until every child is running."""
        args = ["up", "--detach"]
        if config is not None:
            args += ["--config", str(config)]
        self.run(*args, *extra, timeout_s=90)
        self.wait_running(timeout_s=60)

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = self.json("status")
        return data

    def children(self) -> dict[str, dict[str, Any]]:
        return {c["name"]: c for c in self.status()["children"]}

    def wait_running(self, names: list[str] | None = None, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            result = self.run("status", "--json", rc=None)
            if result.returncode != 0:
                return False
            kids = {c["name"]: c for c in result.json()["children"]}
            wanted = names or list(kids)
            return bool(wanted) and all(
                n in kids and kids[n]["state"] == "running" for n in wanted)
        wait_for(ready, timeout_s, f"children running: {names or 'all'}", interval_s=0.1)

    def wait_state(self, name: str, states: set[str], timeout_s: float = 60.0) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            result = self.run("status", name, "--json", rc=None)
            if result.returncode != 0:
                return None
            for child in result.json()["children"]:
                if child["name"] == name and child["state"] in states:
                    return dict(child)
            return None
        found: dict[str, Any] = wait_for(reached, timeout_s, f"{name} in {sorted(states)}",
                                         interval_s=0.1)
        return found

    def wait(self, condition: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
        return wait_for(condition, timeout_s, what, interval_s=0.1)

    def sessions(self, agent: str | None = None) -> list[dict[str, Any]]:
        """`sessions list --all --json`, only `agent`'s when named (oldest first)."""
        rows: list[dict[str, Any]] = self.json("sessions", "list", "--all")
        return [r for r in rows if agent is None or r["agent"] == agent]

    def wait_session(self, agent: str, statuses: set[str],
                     timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until `agent`'s newest session has one of `statuses`."""
        def reached() -> dict[str, Any] | None:
            rows = self.sessions(agent)
            return rows[-1] if rows and rows[-1]["status"] in statuses else None
        # `sessions list` reads the WAL's new records: poll it less often than status
        found: dict[str, Any] = wait_for(reached, timeout_s,
                                         f"{agent}'s session in {sorted(statuses)}",
                                         interval_s=0.4)
        return found

    def stop(self) -> None:
        if (self.state_dir / "run").exists():
            self.run("stop", rc=None, timeout_s=60)

    def files_text(self) -> Iterator[tuple[Path, bytes]]:
        """Every regular file under the home (for 'is this text anywhere?')."""
        for root, _dirs, files in os.walk(self.home):
            for name in files:
                path = Path(root) / name
                with contextlib.suppress(OSError):
                    if path.is_file() and not path.is_symlink():
                        yield path, path.read_bytes()


@contextlib.contextmanager
def corral_home() -> Iterator[Corral]:
    """A fresh home; at exit the runtime is stopped and leaks fail the test."""
    home = Path(tempfile.mkdtemp(prefix="corral-acc-", dir="/tmp"))
    tracker = ProcessTracker(home)
    user = Corral(home, tracker)
    try:
        yield user
    finally:
        try:
            with contextlib.suppress(Exception):
                user.stop()
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: not tracker.marked(), 10, "the runtime to stop",
                         interval_s=0.05)
            leaked = tracker.cleanup()
        finally:
            shutil.rmtree(home, ignore_errors=True)
        if leaked:
            pytest.fail("processes leaked by the test:\n" + "\n".join(leaked))


@pytest.fixture
def corral() -> Iterator[Corral]:
    with corral_home() as user:
        yield user


@pytest.fixture(scope="module")
def module_corral() -> Iterator[Corral]:
    """One home and runtime for a module's tests (each uses names of its own)."""
    with corral_home() as user:
        yield user
