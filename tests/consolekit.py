"""A runtime and its web console for the console tests (tests/test_console.py,
tests/test_console_browser.py, ops/bench_console.py): `supervisor up
--detach` on a copy of the packaged configuration, agents added through the
control socket (the request `supervisor spawn` sends), `supervisor console`
as a real process, its login URL read from its output, and an HTTP client
(http.client, the cookie carried by hand)."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from broker import protocol
from broker.requester import new_msg_id
from broker.statedir import StateDir
from supervisor import client
from supervisor.config import DEFAULT_CONFIG_PATH
from tests.processes import ProcessTracker, wait_for

SUPERVISOR = str(Path(sys.executable).with_name("supervisor"))
LOGIN = re.compile(r"log in \(once\) with (http://\S+/login\?token=\S+)")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Console:
    """A running `supervisor console` and a logged-in session of it."""

    login_url: str
    process: subprocess.Popen[bytes]
    cookie: str = ""
    csrf: str = ""
    set_cookie: str = ""
    base: str = field(init=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.login_url)
        self.base = f"{parts.scheme}://{parts.netloc}"
        self.host, self.port = str(parts.hostname), int(parts.port or 80)

    def request(self, method: str, path: str, body: bytes | None = None, *,
                cookie: bool = True, csrf: bool = True, headers: dict[str, str] | None = None,
                chunked: bool = False) -> Reply:
        sent = dict(headers or {})
        if cookie and self.cookie:
            sent.setdefault("cookie", self.cookie)
        if csrf and self.csrf and method == "POST":
            sent.setdefault("x-csrf-token", self.csrf)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=sent, encode_chunked=chunked)
            response = conn.getresponse()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                         response.read())
        finally:
            conn.close()

    def get(self, path: str, **kwargs: Any) -> Reply:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, data: Any, **kwargs: Any) -> Reply:
        headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
        return self.request("POST", path, json.dumps(data).encode(), headers=headers, **kwargs)

    def log_in(self) -> None:
        """Spend the login URL: keep the cookie and read the CSRF token."""
        parts = urlsplit(self.login_url)
        reply = self.get(f"{parts.path}?{parts.query}", cookie=False)
        assert reply.status == 303, reply
        self.set_cookie = reply.headers["set-cookie"]
        self.cookie = self.set_cookie.split(";")[0]
        self.csrf = self.get("/api/session").json()["csrf"]


def write_config(home: Path, changes: dict[str, Any]) -> Path:
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = home / "corral.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(tracker: ProcessTracker, home: Path, *args: str,
        timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`supervisor args...` in `home`, to its end."""
    return subprocess.run([SUPERVISOR, *args], cwd=home, env=tracker.env(), text=True,
                          capture_output=True, timeout=timeout_s, check=False,
                          stdin=subprocess.DEVNULL)


def up(tracker: ProcessTracker, home: Path, config: Path) -> StateDir:
    done = run(tracker, home, "up", "--detach", "--config", str(config), timeout_s=120)
    assert done.returncode == 0, done.stderr
    state_dir = StateDir(home / ".corral")

    def core_running() -> bool:
        status = run(tracker, home, "status", "--json")
        if status.returncode != 0:
            return False
        kids = {c["name"]: c["state"] for c in json.loads(status.stdout)["children"]}
        return all(kids.get(n) == "running" for n in ("writer", "broker", "procs"))

    wait_for(core_running, 90, "the runtime's core children", interval_s=0.2)
    return state_dir


def spawn(state_dir: StateDir, name: str, task: Path) -> None:
    """What `supervisor spawn NAME --task FILE` asks, without its interpreter start."""
    client.ask(state_dir, protocol.SpawnRequest(msg_id=new_msg_id("sp"), name=name,
                                                task=str(task.resolve())), timeout_s=10.0)


def write_task(home: Path, name: str, steps: list[dict[str, Any]]) -> Path:
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "prompt": f"task {name}", "steps": steps},
                                   allow_unicode=False))
    return path


def start_console(tracker: ProcessTracker, home: Path, config: Path, *extra: str,
                  name: str = "console") -> Console:
    proc = tracker.spawn([SUPERVISOR, "console", "--config", str(config), *extra], name=name,
                         python=False, cwd=home)
    found = wait_for(lambda: LOGIN.search(tracker.output(name)) or proc.poll() is not None,
                     60, "the console's login URL", interval_s=0.05)
    assert isinstance(found, re.Match), tracker.output(name)
    return Console(found.group(1), proc)


def stop_console(console: Console) -> None:
    if console.process.poll() is None:
        console.process.terminate()
        try:
            console.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            console.process.kill()
            console.process.wait(timeout=15)


@contextlib.contextmanager
def stopped_at_exit(tracker: ProcessTracker, home: Path) -> Iterator[None]:
    """Stop the runtime at exit; any process left fails the caller."""
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            run(tracker, home, "stop", timeout_s=60)
        leaked = tracker.cleanup()
        assert not leaked, f"processes leaked: {leaked}"


def trace_json(tracker: ProcessTracker, home: Path, agent: str) -> list[dict[str, Any]]:
    """`supervisor trace AGENT --json`: the agent's records as the CLI reads them."""
    done = run(tracker, home, "trace", agent, "--json")
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
