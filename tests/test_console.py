"""The web console over HTTP (docs/console.md), against a real runtime and a
real `supervisor console` process: the one-time login URL and its cookie
(HttpOnly, SameSite=Strict), every request without the cookie refused, every
POST without the session's CSRF token (or from another origin) refused and
recording nothing, model text served without terminal escapes and the page
carrying no inline script under a strict CSP, request bodies bounded, an
answer recorded exactly once through the CLI's own code (a second one is
refused with the CLI's words), and a non-loopback --listen refused unless the
configuration allows it. One runtime for the module."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.console import views
from supervisor.console.guard import MAX_BODY_BYTES
from supervisor.console.serve import ListenError, parse_listen
from tests import consolekit
from tests.consolekit import Console
from tests.processes import ProcessTracker, wait_for

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

HOSTILE = "<script>alert('x')</script> \x1b[31mred\x1b[0m \x1b]0;title\x07 colour?"
STATIC = Path(__file__).resolve().parent.parent / "supervisor" / "console" / "static"


class Runtime:
    def __init__(self, home: Path, tracker: ProcessTracker, config: Path,
                 console: Console) -> None:
        self.home, self.tracker, self.config, self.console = home, tracker, config, console


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    home = Path(tempfile.mkdtemp(prefix="corral-con-", dir="/tmp"))
    tracker = ProcessTracker(home)
    try:
        with consolekit.stopped_at_exit(tracker, home):
            config = consolekit.write_config(home, {"agents": {"restart": "transient"}})
            state_dir = consolekit.up(tracker, home, config)
            ask = consolekit.write_task(home, "asks", [
                {"op": "ask", "question": HOSTILE}, {"op": "finish", "summary": "ok"}])
            consolekit.spawn(state_dir, "asker", ask)
            console = consolekit.start_console(tracker, home, config)
            console.log_in()
            try:
                wait_for(lambda: console.get("/api/queue").json()["queue"], 60,
                         "the question in the console's queue", interval_s=0.1)
                yield Runtime(home, tracker, config, console)
            finally:
                consolekit.stop_console(console)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_login_url_is_spent_once_and_sets_a_strict_httponly_cookie(
        runtime: Runtime) -> None:
    console = runtime.console
    cookie = console.set_cookie.lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
    again = console.get(console.login_url.removeprefix(console.base), cookie=False)
    assert again.status == 401 and "already used" in again.json()["error"]
    wrong = console.get("/login?token=nope", cookie=False)
    assert wrong.status == 401 and "set-cookie" not in wrong.headers


@pytest.mark.parametrize("path", ["/", "/api/agents", "/api/queue", "/api/session",
                                  "/api/trace/asker", "/api/storage", "/static/console.js"])
def test_every_request_without_the_cookie_is_refused(runtime: Runtime, path: str) -> None:
    assert runtime.console.get(path, cookie=False).status == 401
    forged = runtime.console.get(path, cookie=False,
                                 headers={"cookie": "corral_console=forged"})
    assert forged.status == 401


def _pending(console: Console) -> list[dict[str, Any]]:
    queue: list[dict[str, Any]] = console.get("/api/queue").json()["queue"]
    return queue


def test_a_post_without_the_csrf_token_or_from_another_origin_records_nothing(
        runtime: Runtime) -> None:
    console = runtime.console
    [item] = _pending(console)
    answer = {"agent": "asker", "request": item["request"], "text": "blue"}
    assert console.post("/api/answer", answer, csrf=False).status == 403
    wrong = console.post("/api/answer", answer, headers={"x-csrf-token": "0" * 43})
    assert wrong.status == 403 and "CSRF" in wrong.json()["error"]
    cross = console.post("/api/answer", answer, headers={"origin": "http://evil.example"})
    assert cross.status == 403 and "cross-origin" in cross.json()["error"]
    assert console.post("/api/answer", answer, cookie=False).status == 401
    assert _pending(console) == [item]
    records = consolekit.trace_json(runtime.tracker, runtime.home, "asker")
    assert not [r for r in records if r["event"] == "operator_answer"]


def test_model_text_is_served_plain_and_the_page_runs_no_inline_script(
        runtime: Runtime) -> None:
    console = runtime.console
    [item] = _pending(console)
    assert item["kind"] == "clarification"
    assert "\x1b" not in item["question"] and "\x07" not in item["question"]
    assert item["question"].startswith("<script>alert('x')</script> red")  # text, as text
    trace = console.get("/api/trace/asker").json()["records"]
    asked = [r for r in trace if r["event"] == "approval_requested"]
    assert asked and all("\x1b" not in r["text"] for r in trace)
    page = console.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp and page.headers["x-content-type-options"] == "nosniff"
    html = page.body.decode()
    assert "<script>" not in html.replace('<script src="/static/console.js" defer></script>', "")
    script = (STATIC / "console.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "document.write" not in script and "eval(" not in script


def test_request_bodies_and_fields_are_bounded(runtime: Runtime) -> None:
    console = runtime.console
    big = b"x" * (MAX_BODY_BYTES + 1)
    declared = console.request("POST", "/api/correct", big,
                               headers={"content-type": "application/json"})
    assert declared.status == 413
    chunked = console.request("POST", "/api/correct", iter([big[:40000], big[40000:]]),  # type: ignore[arg-type]
                              headers={"content-type": "application/json"}, chunked=True)
    assert chunked.status == 413
    long_text = console.post("/api/correct", {"agent": "asker", "text": "y" * 40_000})
    assert long_text.status == 400 and "text" in long_text.json()["error"]
    assert console.post("/api/correct", {"agent": "../etc", "text": "t"}).status == 400
    assert console.post("/api/approve", {"agent": "asker", "request": "r", "decision": "maybe"}
                        ).status == 400
    assert console.post("/api/approve", {"agent": "asker", "request": "r", "decision": "approve",
                                         "extra": 1}).status == 400
    not_json = console.request("POST", "/api/correct", b"{", headers={
        "content-type": "application/json"})
    assert not_json.status == 400
    assert console.get("/api/trace/asker?since=-1").status == 400
    assert console.get("/api/trace/a%20b").status == 400
    assert console.get("/api/agents").status == 200  # the console lived through all of it


def test_an_answer_from_the_console_is_recorded_once_and_a_second_is_refused(
        runtime: Runtime) -> None:
    console = runtime.console
    [item] = _pending(console)
    # a question is not a permission: the CLI's refusal, in its words
    wrong_kind = console.post("/api/approve", {"agent": "asker", "request": item["request"],
                                               "decision": "approve"})
    assert wrong_kind.status == 409 and "is a question, not a permission" in \
        wrong_kind.json()["error"]
    answer = {"agent": "asker", "request": item["request"], "text": "blue"}
    first = console.post("/api/answer", answer)
    assert first.status == 200 and first.json()["line"].startswith(
        f"answered asker {item['request']}")
    second = console.post("/api/answer", answer)
    # refused either way: still answered, or (the agent quick) its turn already closed
    assert second.status == 409 and re.search(
        rf"already answered|has no question {re.escape(item['request'])}",
        second.json()["error"])

    def finished() -> list[dict[str, Any]]:
        records = consolekit.trace_json(runtime.tracker, runtime.home, "asker")
        return records if any(r["event"] == "session_exit" for r in records) else []

    records = wait_for(finished, 60, "asker to finish after its answer", interval_s=0.2)
    answers = [r for r in records if r["event"] == "operator_answer"]
    assert len(answers) == 1 and answers[0]["text"] == "blue"
    assert _pending(console) == []


def test_a_non_loopback_listen_is_refused_unless_the_configuration_allows_it(
        runtime: Runtime) -> None:
    refused = consolekit.run(runtime.tracker, runtime.home, "console", "--config",
                             str(runtime.config), "--listen", "0.0.0.0:0")
    assert refused.returncode == 2
    assert refused.stderr.startswith("supervisor: ") and "not a loopback" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "token" not in refused.stdout
    bad = consolekit.run(runtime.tracker, runtime.home, "console", "--listen", "nohost")
    assert bad.returncode == 2 and "host:port" in bad.stderr
    allowed = consolekit.write_config(runtime.home, {"console": {"allow_remote": True}})
    console = consolekit.start_console(runtime.tracker, runtime.home, allowed, "--listen",
                                       "0.0.0.0:0", name="console-remote")
    try:
        assert console.login_url.startswith("http://0.0.0.0:")
        assert console.get("/api/agents", cookie=False).status == 401
    finally:
        consolekit.stop_console(console)


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:8080", allow_remote=False) == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:0", allow_remote=False) == ("::1", 0)
    assert parse_listen("localhost:9", allow_remote=False) == ("127.0.0.1", 9)
    assert parse_listen("10.0.0.5:80", allow_remote=True) == ("10.0.0.5", 80)
    for text in ("10.0.0.5:80", "example.com:80", ":80", "127.0.0.1", "127.0.0.1:99999"):
        with pytest.raises(ListenError):
            parse_listen(text, allow_remote=False)


def test_plain_text_drops_terminal_escapes_and_shows_other_controls() -> None:
    assert views.plain("\x1b[1;31mred\x1b[0m\x1b]8;;http://x\x07link\x1b]8;;\x07") == "redlink"
    assert views.plain("a\x00b\rc\td\ne") == "a\\x00b\\x0dc\td\ne"
    assert views.plain("x" * 50, limit=10) == "x" * 10 + "... (50 chars)"


def test_only_rows_that_changed_what_the_operator_follows_are_sent() -> None:
    row = {"name": "a1", "kind": "agent", "state": "running", "turn": 1, "cpu": 3.0}
    before = {"a1": row, "a2": {**row, "name": "a2"}}
    moved, gone = views.changed(before, [{**row, "cpu": 9.0}, {**row, "name": "a3"}])
    assert [r["name"] for r in moved] == ["a3"] and gone == ["a2"]
    moved, _ = views.changed(before, [{**row, "turn": 2}])
    assert [r["turn"] for r in moved] == [2]


def test_up_and_status_never_import_the_console() -> None:
    """The console is an optional part: the paths of `up` and `status` load none of it."""
    code = ("import sys; import supervisor.cli, supervisor.runtime.up, supervisor.runtime.loop, "
            "supervisor.statusclient; bad = sorted(m for m in sys.modules if "
            "m.startswith(('supervisor.console', 'starlette', 'uvicorn'))); print(bad)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_rows_of_a_reply_with_odd_values_are_made_without_raising() -> None:
    """A child's heartbeat values are its own: odd ones show as nothing."""
    reply = {"children": [{"name": "a1", "kind": "agent", "state": "running",
                           "values": {"phase": [1], "turn": "x", "waiting": 1e300},
                           "busy": None},
                          {"name": "a2", "kind": "agent", "state": "running",
                           "values": {"phase": 3, "turn": 4}, "busy": {"op": "bash",
                                                                       "since_s": 2.0}}]}
    odd, fine = views.rows(reply)
    assert odd["phase"] is None and odd["turn"] is None
    assert fine["phase"] == "finished" and fine["turn"] == 4 and fine["busy"] == "bash"
