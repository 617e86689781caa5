"""The web console in a real browser (docs/console.md): Debian's chromium,
headless, driven by Playwright, against a runtime of 20 scripted agents (one
asks a question, one waits for an approval, one writes `<script>` tags and
terminal escapes into its trace) and a `supervisor console` process.

The agents page lists all 20 and updates a row in place when its agent
finishes; the queue answers the question and approves the request from the
page, and the agents go on to finish (checked with `supervisor trace
--json`); the hostile agent's trace renders as text (no element made, no
dialog); requests without the cookie or the CSRF token are refused.
Screenshots go to $CORRAL_CONSOLE_SHOTS (docs/console/ for the docs), else to
the test's temporary directory. Skipped, with the reason, only where
chromium is absent outside CI (.ci/run installs it)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import consolekit
from tests.consolekit import Console
from tests.processes import ProcessTracker, wait_for

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run "
                "installs it)", allow_module_level=True)
from playwright import sync_api as playwright_api  # noqa: E402 - after the skip above

WAIT_MS = 90_000  # a loaded 2-core machine: condition waits, generous deadlines
HOSTILE_TEXT = "<script>alert('trace')</script><img src=x onerror=alert('img')>\x1b[31mRED\x1b[0m"
QUESTION = "Ship it? <script>alert('question')</script>\x1b[1mbold\x1b[0m"
WORKERS = 17


@dataclass
class Fleet:
    home: Path
    tracker: ProcessTracker
    console: Console
    shots: Path
    browser: Any
    context: Any
    dialogs: list[str]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    home = Path(tempfile.mkdtemp(prefix="corral-web-", dir="/tmp"))
    tracker = ProcessTracker(home)
    shots = Path(os.environ.get("CORRAL_CONSOLE_SHOTS") or home / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    try:
        with consolekit.stopped_at_exit(tracker, home):
            config = consolekit.write_config(home, {"agents": {"restart": "transient"}})
            state_dir = consolekit.up(tracker, home, config)
            tasks = {
                "asker": [{"op": "ask", "question": QUESTION},
                          {"op": "finish", "summary": "asked"}],
                "approver": [{"op": "write_file", "path": "release/NOTES.md",
                              "content": "0.1\n"}, {"op": "finish", "summary": "released"}],
                "hostile": [{"op": "write_file", "path": "x.html", "content": HOSTILE_TEXT},
                            {"op": "finish", "summary": HOSTILE_TEXT + " javascript:alert(1)"}],
                **{f"worker-{i:02d}": [{"op": "write_file", "path": f"w{i}.txt",
                                        "content": f"{i}\n"}, {"op": "finish"}]
                   for i in range(1, WORKERS + 1)},
            }
            for name, steps in tasks.items():
                consolekit.spawn(state_dir, name, consolekit.write_task(home, name, steps))
            console = consolekit.start_console(tracker, home, config)
            try:
                with playwright_api.sync_playwright() as pw:
                    browser = pw.chromium.launch(
                        executable_path=CHROMIUM, headless=True,
                        args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
                    context = browser.new_context(viewport={"width": 1400, "height": 860})
                    context.set_default_timeout(WAIT_MS)
                    dialogs: list[str] = []

                    def on_dialog(dialog: Any) -> None:
                        dialogs.append(dialog.message)  # a script ran: the test fails
                        dialog.dismiss()

                    def on_page(page: Any) -> None:
                        page.on("dialog", on_dialog)

                    context.on("page", on_page)
                    try:
                        yield Fleet(home, tracker, console, shots, browser, context, dialogs)
                    finally:
                        context.close()
                        browser.close()
            finally:
                consolekit.stop_console(console)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _logged_in(fleet: Fleet) -> Any:
    """The context's first page logs in with the one-time URL; later ones share its cookie."""
    page = fleet.context.new_page()
    if not fleet.context.cookies():
        page.goto(fleet.console.login_url)
    else:
        page.goto(fleet.console.base + "/")
    page.wait_for_function("() => document.getElementById('live').textContent === 'live'")
    return page


def _row(page: Any, name: str) -> Any:
    return page.locator(f"#agents-body tr[data-name='{name}']")


def test_the_agents_page_lists_all_20_and_a_finish_updates_its_row_in_place(
        fleet: Fleet) -> None:
    page = _logged_in(fleet)
    page.wait_for_function("() => document.getElementById('agents-summary').textContent"
                           ".includes('(20 agents)')")
    names = page.eval_on_selector_all("#agents-body tr td[data-key='kind']",
                                      "cells => cells.filter(c => c.textContent === 'agent')"
                                      ".map(c => c.parentElement.dataset.name)")
    assert len(names) == 20 and {"asker", "approver", "hostile"} <= set(names)
    page.wait_for_function("() => document.querySelector(\"tr[data-name='approver'] "
                           "td[data-key='waiting']\").textContent === '1'")
    budget = page.locator("tr[data-name='worker-01'] td[data-key='tokens']").inner_text()
    assert budget.endswith(" of 2000000")  # the spec's budget (the packaged default)
    page.fill("#filter", "worker")
    page.wait_for_function("() => document.getElementById('agents-summary').textContent"
                           ".endsWith(', 17 shown')")
    page.fill("#filter", "")
    page.click("#agents-head th[data-key='turn']")  # sortable
    page.screenshot(path=str(fleet.shots / "agents.png"))

    # the approval is given elsewhere (the CLI's path, as the queue test does from
    # the page); this page was never reloaded and its row must follow
    marker = page.evaluate("document.querySelector(\"tr[data-name='approver']\").dataset.mark"
                           " = 'same-row'")
    assert marker == "same-row"
    queue = _logged_in(fleet)
    queue.goto(fleet.console.base + "/#queue")
    card = queue.locator(".card[data-agent='approver']")
    card.locator("button.approve").click()
    card.locator(".result.ok").wait_for()
    page.wait_for_function("() => document.querySelector(\"tr[data-name='approver']\")"
                           ".dataset.phase === 'finished'")
    assert _row(page, "approver").get_attribute("data-mark") == "same-row"  # not reloaded
    queue.close()
    page.close()

    def approved() -> list[dict[str, Any]]:
        records = consolekit.trace_json(fleet.tracker, fleet.home, "approver")
        return records if any(r["event"] == "session_exit" for r in records) else []

    records = wait_for(approved, 90, "approver to finish", interval_s=0.2)
    [answer] = [r for r in records if r["event"] == "approval_answer"]
    assert answer["origin"] == "operator" and answer["payload"]["decision"] == "approve"
    assert [r["payload"]["status"] for r in records
            if r["event"] == "tool_result" and r["payload"].get("op") == "write_file"] == ["ok"]


def test_the_queue_answers_the_question_from_the_page_and_the_agent_goes_on(
        fleet: Fleet) -> None:
    page = _logged_in(fleet)
    page.goto(fleet.console.base + "/#queue")
    card = page.locator(".card[data-agent='asker']")
    card.wait_for()
    question = card.locator(".question").inner_text()
    assert question.startswith("Ship it? <script>alert('question')</script>bold")
    assert card.locator("script").count() == 0 and "\x1b" not in question
    page.screenshot(path=str(fleet.shots / "queue.png"))
    card.locator("textarea.answer-text").fill("yes, ship 0.1")
    card.locator("button.answer").click()
    card.locator(".result.ok").wait_for()
    assert card.locator(".result").inner_text().startswith("answered asker req-1.0")
    page.wait_for_function("() => document.getElementById('queue-count').textContent === '0'")
    assert card.locator("button.answer").is_disabled()  # settled: no second answer from here
    page.close()

    def finished() -> list[dict[str, Any]]:
        records = consolekit.trace_json(fleet.tracker, fleet.home, "asker")
        return records if any(r["event"] == "session_exit" for r in records) else []

    records = wait_for(finished, 90, "asker to finish after the answer", interval_s=0.2)
    answers = [r for r in records if r["event"] == "operator_answer"]
    assert len(answers) == 1 and answers[0]["text"] == "yes, ship 0.1"
    assert any(r["event"] == "clarification_consumed" for r in records)


def test_a_hostile_trace_renders_as_text(fleet: Fleet) -> None:
    page = _logged_in(fleet)
    page.goto(fleet.console.base + "/#session/hostile")
    page.locator("#trace .rec[data-event='session_exit']").wait_for()
    text = page.locator("#trace").inner_text()
    assert "<script>alert('trace')</script><img src=x onerror=alert('img')>" in text
    assert "javascript:alert(1)" in text and "\x1b" not in text
    assert page.locator("#trace script, #trace img, #trace a").count() == 0
    assert page.evaluate("document.scripts.length") == 1  # console.js alone
    page.wait_for_function("() => document.getElementById('cmd-fork').textContent"
                           ".includes('--at-turn')")
    page.screenshot(path=str(fleet.shots / "session.png"))
    page.goto(fleet.console.base + "/#storage")
    page.locator("#storage-sessions tbody tr").first.wait_for()
    page.screenshot(path=str(fleet.shots / "storage.png"))
    page.close()
    assert fleet.dialogs == []


def test_requests_without_the_cookie_or_the_csrf_token_are_refused(fleet: Fleet) -> None:
    page = _logged_in(fleet)
    status = page.evaluate("""async () => {
        const body = JSON.stringify({agent: 'asker', text: 'from a forged page'});
        const bare = await fetch('/api/correct', {method: 'POST', body,
            headers: {'content-type': 'application/json'}});
        const wrong = await fetch('/api/correct', {method: 'POST', body,
            headers: {'content-type': 'application/json', 'x-csrf-token': 'guess'}});
        return [bare.status, wrong.status];
    }""")
    assert status == [403, 403]
    page.close()
    stranger = fleet.browser.new_context()
    try:
        reply = stranger.request.get(fleet.console.base + "/api/agents")
        assert reply.status == 401
        spent = stranger.request.get(fleet.console.login_url, max_redirects=0)
        assert spent.status == 401  # the login URL was spent by the first page
        forged = stranger.request.post(fleet.console.base + "/api/correct",
                                       data={"agent": "asker", "text": "x"})
        assert forged.status == 401
    finally:
        stranger.close()
    records = consolekit.trace_json(fleet.tracker, fleet.home, "asker")
    assert not [r for r in records if r["event"] == "operator_correction"]
