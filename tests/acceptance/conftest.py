"""The acceptance harness: corral driven only as a user drives it.

A test gets a `Corral` (the `corral` fixture): a fresh home directory, the
`supervisor` command run as a subprocess in it, and helpers to write the
files the docs tell users to write (configuration, task files). Nothing here
imports corral's modules or writes into `.corral/` by hand
(tests/acceptance/test_user_only.py checks that). At teardown the runtime is
stopped with `supervisor stop`, and any process left with the test's marker
fails the test (tests/processes.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.processes import ProcessTracker, wait_for

SUPERVISOR = str(Path(sys.executable).with_name("supervisor"))
pytestmark = pytest.mark.process


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
        """A configuration file: the user's keys over the defaults."""
        return self.write(name, text)

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


@pytest.fixture
def corral() -> Iterator[Corral]:
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
