"""`python ops/bench.py status`: `supervisor status` against `circusctl status`,
each run as a whole command (interpreter start, imports, request, printing),
with the same number of idle children under each, interleaved.

Corral runs N idle agents (`supervisor up`, agents.count N); circus runs N
`sleep` watchers. circus comes with corral's `bench` extra (`pip install -e
'.[bench]'`, circusctl beside corral's interpreter); without it, circus is
installed into a virtual environment of the bench's own (cached in
~/.cache/corral-bench/circus-venv, or $CORRAL_BENCH_CIRCUS_VENV); when it cannot
be installed the circus figure is skipped and `circus_skipped` says why.

Figures:
    children                     N (300; 30 with --quick; --children 8 for
                                 the issue's "8 agents" target)
    runs                         per command (20; 5 with --quick)
    status_cli_ms_p50            `supervisor status` (the console script)
    status_json_ms_p50           `supervisor status --json`
    circusctl_ms_p50             `circusctl status` with N watchers
    python_startup_ms_p50        baseline: `python -c pass` (corral's interpreter)
    status_vs_circusctl          status_cli_ms_p50 / circusctl_ms_p50 (target <= 1)
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ops.bench_spawn import Run
from ops.benchkit import temp_state_root


def _circus_venv() -> tuple[Path | None, str | None]:
    """circusd/circusctl's directory, or None and the reason."""
    here = Path(sys.executable).parent  # the `bench` extra installs circus here
    if (here / "circusctl").exists() and (here / "circusd").exists():
        return here, None
    venv = Path(os.environ.get("CORRAL_BENCH_CIRCUS_VENV")
                or Path.home() / ".cache" / "corral-bench" / "circus-venv")
    bindir = venv / "bin"
    if (bindir / "circusctl").exists() and (bindir / "circusd").exists():
        return bindir, None
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                       capture_output=True, timeout=300)
        subprocess.run([str(bindir / "pip"), "install", "-q", "circus"], check=True,
                       capture_output=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return None, f"pip install circus failed: {exc} {detail.decode(errors='replace')[-300:]}"
    if not (bindir / "circusctl").exists():
        return None, "circus installed no circusctl"
    return bindir, None


class Circus:
    """circusd with `count` `sleep` watchers, in the foreground of its own group."""

    def __init__(self, bindir: Path, root: Path, count: int) -> None:
        self.bindir = bindir
        self.endpoint = f"ipc://{root}/circus.sock"
        lines = ["[circus]", f"endpoint = {self.endpoint}",
                 f"pubsub_endpoint = ipc://{root}/circus-pub.sock", "check_delay = 5",
                 "statsd = False", ""]
        for i in range(count):
            lines += [f"[watcher:w{i}]", "cmd = sleep 1000000", "numprocesses = 1",
                      "graceful_timeout = 1", ""]
        config = root / "circus.ini"
        config.write_text("\n".join(lines))
        self.out = (root / "circusd.out").open("wb")
        self.proc = subprocess.Popen([str(bindir / "circusd"), str(config)],
                                     stdin=subprocess.DEVNULL, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.count = count

    def command(self) -> list[str]:
        return [str(self.bindir / "circusctl"), "--endpoint", self.endpoint, "status"]

    def wait_all_active(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        active = 0
        while time.monotonic() < deadline and self.proc.poll() is None:
            done = subprocess.run(self.command(), capture_output=True, text=True, check=False)
            active = sum(line.endswith(": active") for line in done.stdout.splitlines())
            if active >= self.count:
                return active
            time.sleep(0.5)
        return active

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()


def _timed(command: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   check=True)
    return (time.perf_counter() - t0) * 1000


def run(quick: bool, count: int | None = None, runs: int | None = None) -> dict[str, object]:
    count = count or (30 if quick else 300)
    runs = runs or (5 if quick else 20)
    figures: dict[str, Any] = {"children": count, "runs": runs, "cpu_count": os.cpu_count()}
    console = Path(sys.executable).parent / "supervisor"
    if not console.exists():
        figures["error"] = f"no console script {console} (pip install -e . first)"
        return figures
    bindir, reason = _circus_venv()
    if reason is not None:
        figures["circus_skipped"] = reason
    with temp_state_root("cst-") as root:
        corral = Run(root, count)
        circus = Circus(bindir, root, count) if bindir is not None else None
        try:
            running = corral.wait_all_running(timeout_s=60 + count * 0.4)
            figures["agents_running"] = len(running)
            if circus is not None:
                figures["watchers_active"] = circus.wait_all_active(60 + count * 0.2)
            state = str(corral.state.root)
            env = dict(os.environ)
            env.pop("CORRAL_STATE_DIR", None)
            samples: dict[str, list[float]] = {"status_cli": [], "status_json": [],
                                               "circusctl": [], "python_startup": []}
            for _ in range(runs):
                samples["status_cli"].append(
                    _timed([str(console), "status", "--state-dir", state], env))
                samples["status_json"].append(
                    _timed([str(console), "status", "--json", "--state-dir", state], env))
                if circus is not None:
                    samples["circusctl"].append(_timed(circus.command()))
                samples["python_startup"].append(_timed([sys.executable, "-c", "pass"]))
            for key, values in samples.items():
                if values:
                    figures[f"{key}_ms_p50"] = round(statistics.median(values), 1)
            if samples["circusctl"]:
                figures["status_vs_circusctl"] = round(
                    figures["status_cli_ms_p50"] / figures["circusctl_ms_p50"], 2)
                figures["status_json_vs_circusctl"] = round(
                    figures["status_json_ms_p50"] / figures["circusctl_ms_p50"], 2)
        finally:
            corral.stop()
            if circus is not None:
                circus.stop()
    return figures


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--children", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.children, args.runs), indent=2, sort_keys=True))
