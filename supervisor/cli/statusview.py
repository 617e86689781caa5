"""Rendering a status for a terminal. Standard library only.

See docs/supervisor.md ("Status").
"""

from __future__ import annotations

import time
from typing import Any

COLUMNS = ("NAME", "KIND", "PID", "STATE", "UPTIME", "RESTARTS", "LAST EXIT", "CPU%",
           "RSS", "USS", "HEARTBEAT", "INFO")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1048576:.1f}M"


def _info(child: dict[str, Any]) -> str:
    busy = child.get("busy")
    text = _counters(child)
    if isinstance(busy, dict):  # in a call: say which, and for how long
        call = f"busy={busy.get('op')} {_duration(busy.get('since_s'))}"
        return f"{call} {text}".rstrip()
    idle_s = (child.get("values") or {}).get("idle_s")
    if idle_s is not None:  # waits for work: held alive by its process (docs/supervisor.md)
        return f"idle {_duration(idle_s)} {text}".rstrip()
    return text


def _counters(child: dict[str, Any]) -> str:
    values = child.get("values") or {}
    if child.get("kind") == "writer" and values.get("storage_full"):  # docs/storage.md
        return f"STORAGE FULL, appends stopped ({values.get('storage_free_bytes')} bytes free)"
    if child.get("kind") == "writer" and "head_seq" in values:
        return f"seq={values['head_seq']} {values.get('appends_per_s', 0)}/s"
    if child.get("kind") == "procs" and "live_commands" in values:
        return f"commands={values['live_commands']} terminals={values['live_terminals']}"
    if child.get("kind") == "subagents" and "running_children" in values:
        return f"children={values['running_children']} applied={values.get('applied_total', 0)}"
    if "ready_ms" in values:
        return f"ready={values['ready_ms']}ms"
    return ""


def render(status: dict[str, Any], stale_age_s: float | None = None) -> str:
    rows = [COLUMNS]
    for c in status.get("children", []):
        alive = bool(c.get("pid"))  # no process: no heartbeat, no live counters
        rows.append((
            c["name"], c["kind"], str(c["pid"]) if alive else "-", c["state"],
            _duration(c.get("uptime_s")), str(c.get("restarts", 0)), c.get("last_exit") or "-",
            "-" if c.get("cpu_percent") is None else f"{c['cpu_percent']:.1f}",
            _mib(c.get("rss_bytes")), _mib(c.get("uss_bytes")),
            _duration(c.get("heartbeat_age_s")) if alive else "-", _info(c) if alive else "",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    up = time.time() - float(status.get("started_at", time.time()))
    head = (f"supervisor pid {status.get('supervisor_pid')}  up {_duration(up)}  "
            f"{status.get('state_dir')}")
    if stale_age_s is not None:
        head += f"  [STALE: no answer; status file {stale_age_s:.1f}s old]"
    counts: dict[str, int] = {}
    for c in status.get("children", []):
        counts[c["state"]] = counts.get(c["state"], 0) + 1
    summary = "  ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    return "\n".join([head, *lines, summary])
