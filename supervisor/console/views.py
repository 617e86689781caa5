"""What each console page shows, read from the sources the CLI reads. Blocking.

Text from a model or a command is made plain here (`plain`) and put in the
DOM as text only. See docs/console.md ("Where the data comes from").
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from typing import Any

import zmq

from broker.statedir import StateDir
from supervisor import statusclient

STATUS_TIMEOUT_S = 2.0
TRACE_PAGE = 2000  # records per trace request; the page asks again from the next seq
PHASES = {0: "new", 1: "running", 2: "paused", 3: "finished", 4: "closed"}
# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST), and two-byte escapes
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)}


def plain(text: object, limit: int = 4000) -> str:
    """Model or command text for the page: no terminal escapes, bounded."""
    out = _ANSI.sub("", str(text)).translate(_CONTROLS)
    return out if len(out) <= limit else f"{out[:limit]}... ({len(out)} chars)"


# --- agents ---------------------------------------------------------------------------
def status(state_dir: StateDir) -> dict[str, Any]:
    """The supervisor's status reply (raises statusclient.NoAnswerError, RefusedError)."""
    return statusclient.ask_status(state_dir, STATUS_TIMEOUT_S)


def status_rows(state_dir: StateDir, limits: BudgetLimits | None = None
                ) -> list[dict[str, Any]]:
    """`rows` of a status asked now (the errors of `status`)."""
    return rows(status(state_dir), limits)


def _num(value: object) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


class BudgetLimits:
    """Each agent's token budget from its spec (`config/agents/NAME.json`, the
    settings it runs with), read again only when the file changes. Resumes
    (`supervisor resume`) add to it; the page shows the spec's figure."""

    def __init__(self, state_dir: StateDir) -> None:
        self.state_dir = state_dir
        self._known: dict[str, tuple[int, int | None]] = {}

    def tokens(self, name: str) -> int | None:
        from actors.kernel.settings import read_spec, spec_path  # noqa: PLC0415
        from broker.errors import ConfigError  # noqa: PLC0415

        try:
            changed_ns = spec_path(self.state_dir, name).stat().st_mtime_ns
        except (OSError, ValueError):
            return None
        known = self._known.get(name)
        if known is not None and known[0] == changed_ns:
            return known[1]
        try:
            spec = read_spec(self.state_dir, name)
            limit = spec.settings.budget.tokens if spec is not None else None
        except ConfigError:
            limit = None
        self._known[name] = (changed_ns, limit)
        return limit


def _phase(value: object) -> str | None:
    code = _num(value)
    return PHASES.get(int(code)) if code is not None and abs(code) < 1e6 else None


def rows(reply: dict[str, Any], limits: BudgetLimits | None = None) -> list[dict[str, Any]]:
    """One row per child: what the Agents page shows. Ages are turned into
    moments (`*_at`, epoch seconds) so a row changes only when its child does."""
    now = time.time()
    out = []
    for child in reply.get("children", []):
        values = child.get("values") or {}
        busy = child.get("busy") or None
        kind = str(child.get("kind", ""))
        uptime = _num(child.get("uptime_s"))
        heartbeat = _num(child.get("heartbeat_age_s"))
        out.append({
            "name": plain(child.get("name"), 64), "kind": kind,
            "state": str(child.get("state")), "pid": child.get("pid"),
            "phase": _phase(values.get("phase")) if kind == "agent" else None,
            "turn": _num(values.get("turn")), "waiting": _num(values.get("waiting")),
            "busy": plain(busy["op"], 64) if busy else None,
            "busy_at": round(now - float(busy["since_s"]), 1) if busy else None,
            "restarts": child.get("restarts"), "last_exit": child.get("last_exit"),
            "tokens": _num(values.get("tokens_used")), "cost": _num(values.get("cost_used")),
            "budget_tokens": (limits.tokens(str(child.get("name")))
                              if limits is not None and kind == "agent" else None),
            "cpu": _num(child.get("cpu_percent")), "rss": _num(child.get("rss_bytes")),
            "started_at": round(now - uptime, 1) if uptime is not None else None,
            "heartbeat_at": round(now - heartbeat, 1) if heartbeat is not None else None,
        })
    return out


SIGNIFICANT = ("state", "pid", "phase", "turn", "waiting", "busy", "restarts", "last_exit",
               "tokens", "cost", "budget_tokens")


def changed(before: dict[str, dict[str, Any]], after: list[dict[str, Any]]
            ) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows whose child changed in what the operator follows (state, turn, busy
    call, ...), and the names gone; CPU, memory and ages ride on full refreshes."""
    names = {r["name"] for r in after}
    moved = [r for r in after if r["name"] not in before
             or any(before[r["name"]].get(k) != r.get(k) for k in SIGNIFICANT)]
    return moved, sorted(set(before) - names)


# --- the operator's queue ----------------------------------------------------------------
def _writer(state_dir: StateDir) -> tuple[zmq.Context[zmq.Socket[bytes]], Any]:
    from actors.writer.client import WriterClient  # noqa: PLC0415 - pydantic, on demand
    from broker import auth  # noqa: PLC0415

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    return ctx, WriterClient(ctx, state_dir, "operator", timeout_s=2.0, retries=1,
                             credential=auth.operator_credential(state_dir))


def pending(state_dir: StateDir, names: list[str]) -> list[dict[str, Any]]:
    """The pending approvals and questions of the named agents, from each one's
    rebuilt state (actors/sessions/rebuild.py: what `supervisor approve` checks)."""
    if not names:
        return []
    from actors.sessions.rebuild import rebuild  # noqa: PLC0415
    from broker.errors import CorralError  # noqa: PLC0415

    ctx, writer = _writer(state_dir)
    out: list[dict[str, Any]] = []
    try:
        for name in names:
            try:
                state = rebuild(writer, state_dir, name).state
            except (CorralError, ValueError):
                continue  # not answered, or unreadable now: shown at the next pass
            for a in state.pending_approvals():
                out.append({"agent": name, "request": a.request, "kind": a.kind,
                            "op": plain(a.op, 200), "pattern": plain(a.pattern, 400),
                            "question": plain(a.question) if a.question is not None else None,
                            "session": state.session, "turn": state.turn})
    finally:
        writer.close()
        ctx.destroy(linger=0)
    return out


# --- a session ---------------------------------------------------------------------------
class TraceFollower:
    """An agent's stream as `supervisor trace` shows it, from a seq on; kept
    open between reads while a page follows it."""

    def __init__(self, state_dir: StateDir, agent: str) -> None:
        from supervisor import trace  # noqa: PLC0415 - pydantic and the WAL reader

        self.state_dir = state_dir
        self.agent = agent
        self.source = trace.Source(state_dir, f"agent/{agent}")

    def read(self, since: int) -> tuple[list[dict[str, Any]], int]:
        """Records from `since` (at most TRACE_PAGE), and the seq to ask next."""
        from actors.sessions.purged import purged_of, visible  # noqa: PLC0415
        from supervisor import trace  # noqa: PLC0415
        from supervisor.tracetrees import abandoned_of  # noqa: PLC0415

        batch = self.source.read(since)[:TRACE_PAGE]
        off = abandoned_of(batch)
        hidden = purged_of(self.state_dir.root, f"agent/{self.agent}")
        agent_dir = self.state_dir.agent_dir(self.agent)
        out = []
        next_seq = since
        for record in batch:
            next_seq = record.seq + 1
            if not visible(record.seq, hidden):
                continue
            out.append({"seq": record.seq, "event": record.event,
                        "abandoned": record.seq in off,
                        "text": plain(trace.render(record, record.seq in off, agent_dir),
                                      20_000)})
        return out, next_seq

    def close(self) -> None:
        self.source.close()


def session(state_dir: StateDir, agent: str) -> dict[str, Any]:
    """The agent's sessions (newest last) with their lineage: parent and forks."""
    from actors.sessions import index  # noqa: PLC0415

    conn = index.open_index(state_dir.root)
    try:
        found = index.list_sessions(conn, include_archived=True, agent=agent)
        for row in found:
            row["children"] = [{"session": str(r[0]), "agent": str(r[1])} for r in conn.execute(
                "SELECT session_id, agent FROM sessions WHERE parent_session=? "
                "ORDER BY session_id", (row["session_id"],))]
            row["segment_list"] = index.segments_of(conn, row["session_id"])
    finally:
        conn.close()
    keep = ("session_id", "agent", "number", "status", "exit_reason", "parent_session",
            "parent_agent", "previous", "label", "turns", "tool_calls", "events", "tokens",
            "created_at", "archived", "children", "segment_list")
    return {"agent": agent,
            "sessions": [{k: (plain(v, 400) if isinstance(v, str) else v)
                          for k, v in row.items() if k in keep} for row in found]}


# --- storage ---------------------------------------------------------------------------
def storage_usage(state_dir: StateDir, config_path: str | None) -> dict[str, Any]:
    """`supervisor du --json`'s data, and the metrics endpoint when it is served."""
    from pathlib import Path  # noqa: PLC0415

    from supervisor import storage  # noqa: PLC0415
    from supervisor.config import load  # noqa: PLC0415

    config = load(Path(config_path) if config_path else None)
    usage = asdict(storage.du(state_dir, config.storage))
    metrics = None
    try:
        port = int((state_dir.run_dir / "metrics.port").read_text().strip())
        host = (config.metrics.listen or "127.0.0.1:0").rpartition(":")[0].strip("[]")
        metrics = f"http://{'127.0.0.1' if host == 'localhost' else host}:{port}/metrics"
    except (OSError, ValueError):
        pass
    fleet = None
    if config.fleet.urls or (state_dir.run_dir / "fleet.json").exists():
        fleet = fleet_hosts(state_dir, config_path)
    return {"usage": usage, "metrics_url": metrics, "fleet": fleet}


def fleet_hosts(state_dir: StateDir, config_path: str | None) -> dict[str, Any] | None:
    """The fleet's hosts and where each agent runs, as `supervisor status --fleet`
    reads them (storage_usage asks only when the fleet is configured, so nothing
    of the fleet is imported otherwise)."""
    from broker.errors import ConfigError  # noqa: PLC0415
    from supervisor.fleet import ctl  # noqa: PLC0415 - the fleet only when it is on

    try:
        config = ctl.fleet_config(state_dir, config_path)
    except ConfigError:
        return None  # a config file without a fleet
    try:
        hosts = ctl.fleet_status(config)
    except Exception as exc:  # noqa: BLE001 - the cluster away: the page says so
        return {"hosts": [], "error": f"the fleet's cluster did not answer ({type(exc).__name__})"}
    return {"hosts": [
        {"host": plain(h["host"], 200), "age_s": h.get("age_s"), "stale": bool(h.get("stale")),
         "dead": bool(h.get("dead")), "supervisor_pid": h.get("supervisor_pid"),
         "agents": sorted(plain(c.get("name", ""), 200) for c in h.get("children", [])
                          if isinstance(c, dict) and c.get("kind") == "agent")}
        for h in hosts], "error": None}
