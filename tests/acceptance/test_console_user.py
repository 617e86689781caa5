"""`supervisor console` as docs/console.md tells an operator to use it: start
it beside a running runtime, open the one-time login URL it prints, read the
agents and the queue, answer a question from it (with the page's CSRF token),
and see the agent go on. HTTP through urllib, no browser (the browser test is
tests/test_console_browser.py)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from http.cookiejar import CookieJar
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

ASK_TASK = """\
name: asker
prompt: ask, then write what was decided
steps:
  - {op: ask, question: "Ship it?"}
  - {op: write_file, path: decided.txt, content: "asked and answered\\n"}
  - {op: finish, summary: decided}
"""
LOGIN = re.compile(r"log in \(once\) with (http://127\.0\.0\.1:\d+)/login\?token=(\S+)")


class Browser:
    """A cookie jar and the requests a page makes."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(CookieJar()))

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with self.opener.open(self.base + path, timeout=30) as reply:
                body = reply.read()
                kind = reply.headers.get("content-type", "")
                return reply.status, json.loads(body) if "json" in kind else body
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def post(self, path: str, data: dict[str, Any], csrf: str | None) -> tuple[int, Any]:
        headers = {"content-type": "application/json"}
        if csrf is not None:
            headers["x-csrf-token"] = csrf
        request = urllib.request.Request(self.base + path, data=json.dumps(data).encode(),
                                         headers=headers, method="POST")
        try:
            with self.opener.open(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


def test_console_login_agents_queue_and_an_answer(corral: Corral) -> None:
    corral.up()
    corral.write("ask.yaml", ASK_TASK)
    corral.run("spawn", "q1", "--task", "ask.yaml")
    console = corral.popen("console", "--listen", "127.0.0.1:0", name="console")
    found = corral.wait(lambda: LOGIN.search((corral.home / "console.out").read_text()),
                        "the console's login URL")
    base, token = found.group(1), found.group(2)

    stranger = Browser(base)  # no login: every page and action is refused
    assert stranger.get("/api/agents")[0] == 401
    assert stranger.post("/api/answer", {"agent": "q1", "request": "req-1.0",
                                         "text": "no"}, csrf=None)[0] == 401

    page = Browser(base)
    status, _ = page.get(f"/login?token={token}")
    assert status == 200  # redirected to the page, the cookie set
    assert Browser(base).get(f"/login?token={token}")[0] == 401  # the URL works once
    status, agents = page.get("/api/agents")
    assert status == 200 and "q1" in {row["name"] for row in agents["rows"]}

    def asked() -> list[dict[str, Any]]:
        return [q for q in page.get("/api/queue")[1]["queue"]
                if q["agent"] == "q1" and q["request"] == "req-1.0"]

    question = corral.wait(asked, "q1's question in the console's queue")[0]
    assert question["kind"] == "clarification" and question["question"] == "Ship it?"
    answer = {"agent": "q1", "request": "req-1.0", "text": "yes, ship it"}
    assert page.post("/api/answer", answer, csrf=None)[0] == 403  # no CSRF token
    csrf = page.get("/api/session")[1]["csrf"]
    status, done = page.post("/api/answer", answer, csrf=csrf)
    assert status == 200 and done["ok"] is True, done
    # the CLI's rule: once. Refused as already answered, or, once the agent has
    # taken the answer, as no longer pending: either way 409 and nothing recorded
    status, again = page.post("/api/answer", answer, csrf=csrf)
    assert status == 409 and ("already answered" in again["error"]
                              or "has no question req-1.0" in again["error"]), again

    corral.wait(lambda: corral.json("status", "q1")["children"][0]["state"] == "exited",
                "q1 to finish after the console's answer")
    trace = [json.loads(line) for line in corral.run("trace", "q1", "--json").stdout.splitlines()]
    answers = [r for r in trace if r["event"] == "operator_answer"]
    assert len(answers) == 1, answers
    assert [r["payload"]["summary"] for r in trace if r["event"] == "session_exit"] == ["decided"]
    console.terminate()
    assert console.wait(timeout=30) == 0
