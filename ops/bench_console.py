"""`python ops/bench.py console`: the web console (docs/console.md) in
Debian's chromium (headless, Playwright) over a runtime of N idle agents.

Figures:
    agents                      N (500; 50 with --quick)
    agents_page_ms_p50          a page opened: its first byte (navigation
                                timing's responseStart) to the whole table
                                rendered (the page's `data-first-rendered`),
                                over `pages` loads, one page at a time, each
                                within live.LINGER_S of the previous one (the
                                console's poller still warm, as for an
                                operator's reload); target <= 1000
    agents_page_ms_max
    page_dom_ready_ms_p50       of which: first byte to DOMContentLoaded (the
                                page, its style sheet and script)
    page_first_frame_ms_p50     first byte to the table's first event received
                                (the rest of agents_page_ms is building it)
    agents_page_cold_ms         the same for the console's very first page
                                (the poller starts with it: one status
                                request more before the first table)
    update_lag_ms_p50           a child's state change (a stop request sent to
                                the supervisor) to its row's state cell
                                changing in an open page (a MutationObserver's
                                Date.now() against the bench's time.time(),
                                one clock), over `changes` agents; target <= 1000
    update_lag_ms_max
    status_request_ms_p50       baseline: one status request for N children
                                (supervisor/statusclient.py), what each poll costs
    poll_interval_ms            baseline: the console's status poll (live.POLL_S)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from broker import protocol
from broker.requester import new_msg_id
from ops.bench_spawn import Run, _env
from ops.benchkit import percentile, temp_state_root
from supervisor import client, statusclient
from supervisor.console import live

LOGIN = re.compile(r"log in \(once\) with (http://\S+/login\?token=\S+)")
WAIT_MS = 180_000
FIRST_PAINT = """() => {
    const nav = performance.getEntriesByType('navigation')[0];
    const table = document.getElementById('agents');
    return Number(table.getAttribute('data-first-rendered')) - nav.responseStart;
}"""
PARTS = """() => {
    const nav = performance.getEntriesByType('navigation')[0];
    const frame = performance.getEntriesByName('agents-frame')[0];
    return [nav.domContentLoadedEventStart - nav.responseStart,
            frame ? frame.startTime - nav.responseStart : -1];
}"""
WATCH = """(name) => {
    window.__seen = window.__seen || {};
    const cell = document.querySelector(`tr[data-name='${name}'] td[data-key='state']`);
    const obs = new MutationObserver(() => {
        if (cell.textContent !== 'running') { window.__seen[name] = Date.now(); obs.disconnect(); }
    });
    obs.observe(cell, {childList: true, characterData: true, subtree: true});
    return cell.textContent;
}"""


def _console(run: Run, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    log = out.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "console", "--state-dir", str(run.state.root),
         "--config", str(run.config_path)], env=_env(), stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = LOGIN.search(out.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"the console did not start: {out.read_text(errors='replace')[-500:]}")


def _page_loads(context: Any, base: str, count: int, pages: int
                ) -> tuple[list[float], list[float], list[float]]:
    """Per load: first byte to the table rendered, to DOMContentLoaded, to the
    table's first frame received."""
    times, dom, frame = [], [], []
    for _ in range(pages):
        page = context.new_page()
        page.goto(base + "/")
        page.wait_for_function(f"() => Number(document.getElementById('agents')"
                               f".getAttribute('data-rows')) >= {count}", timeout=WAIT_MS)
        times.append(float(page.evaluate(FIRST_PAINT)))
        parts = page.evaluate(PARTS)
        dom.append(float(parts[0]))
        frame.append(float(parts[1]))
        page.close()
    return times, dom, frame


def _update_lags(run: Run, context: Any, base: str, names: list[str]) -> list[float]:
    page = context.new_page()
    page.goto(base + "/")
    lags = []
    try:
        for name in names:
            page.wait_for_function(f"() => {{ const c = document.querySelector(\"tr[data-name="
                                   f"'{name}'] td[data-key='state']\"); return c && "
                                   f"c.textContent === 'running'; }}", timeout=WAIT_MS)
            page.evaluate(WATCH, name)
            sent = time.time()
            client.ask(run.state, protocol.StopRequest(msg_id=new_msg_id("bs"), target=name),
                       timeout_s=10.0)
            page.wait_for_function(f"() => window.__seen && window.__seen['{name}']",
                                   timeout=WAIT_MS)
            seen = float(page.evaluate(f"() => window.__seen['{name}']")) / 1000
            lags.append((seen - sent) * 1000)
    finally:
        page.close()
    return lags


def run(quick: bool = False) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    count = 50 if quick else 500
    pages, changes = (3, 5) if quick else (7, 15)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return {"agents": count, "skipped": "Debian's chromium is not installed"}
    figures: dict[str, Any] = {"agents": count, "pages": pages, "changes": changes,
                               "poll_interval_ms": live.POLL_S * 1000}
    with temp_state_root("corral-bcon-") as root:
        runtime = Run(root, count)
        console: subprocess.Popen[bytes] | None = None
        try:
            running = runtime.wait_all_running(timeout_s=900)
            figures["agents_running"] = len(running)
            status_ms = []
            for _ in range(10):
                t0 = time.perf_counter()
                statusclient.ask_status(runtime.state, 10.0)
                status_ms.append((time.perf_counter() - t0) * 1000)
            figures["status_request_ms_p50"] = round(percentile(status_ms, 50), 1)
            console, login = _console(runtime, root / "console.out")
            base = login.split("/login")[0]
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-dev-shm-usage",
                                                   "--disable-gpu"])
                try:
                    context = browser.new_context(viewport={"width": 1400, "height": 900})
                    first = context.new_page()
                    first.goto(login)  # spends the token; the context keeps the cookie
                    first.wait_for_function(
                        f"() => Number(document.getElementById('agents')"
                        f".getAttribute('data-rows')) >= {count + 4}", timeout=WAIT_MS)
                    figures["agents_page_cold_ms"] = round(float(first.evaluate(FIRST_PAINT)), 1)
                    first.close()
                    loads, dom, frame = _page_loads(context, base, count + 4, pages)
                    figures["agents_page_ms_p50"] = round(percentile(loads, 50), 1)
                    figures["page_dom_ready_ms_p50"] = round(percentile(dom, 50), 1)
                    figures["page_first_frame_ms_p50"] = round(percentile(frame, 50), 1)
                    figures["agents_page_ms_max"] = round(max(loads), 1)
                    names = [c.name for c in running][:changes]
                    lags = _update_lags(runtime, context, base, names)
                    figures["update_lag_ms_p50"] = round(percentile(lags, 50), 1)
                    figures["update_lag_ms_max"] = round(max(lags), 1)
                finally:
                    browser.close()
        finally:
            if console is not None and console.poll() is None:
                console.send_signal(signal.SIGTERM)
                try:
                    console.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(console.pid, signal.SIGKILL)
                    console.wait(10)
            runtime.stop()
    figures["targets_met"] = (figures.get("agents_page_ms_p50", 1e9) <= 1000
                              and figures.get("update_lag_ms_p50", 1e9) <= 1000)
    return figures


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
