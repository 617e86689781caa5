"""Schedules and hooks: the supervisor's automation thread (actor `automation`).

It never blocks the supervisor's loop: they exchange work through queues.
See docs/automation.md and docs/decisions.md ("Schedules and hooks run in a
thread of the supervisor").
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import queue
import shlex
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import structlog
import zmq
from croniter import croniter

from actors.registries import entries as registries
from actors.registries import store
from broker import auth, protocol
from broker.errors import CorralError
from broker.statedir import StateDir
from supervisor import automationgrants as grants
from supervisor.automationconfig import AutomationConfig
from supervisor.runtime.face import RuntimeFace

if TYPE_CHECKING:
    from actors.writer.client import WriterClient

log = structlog.get_logger("automation")

ACTOR = auth.AUTOMATION
SCHEDULES_STREAM = "automation/schedules"
HOOKS_STREAM = "automation/hooks"
# tests only: a file holding seconds added to the wall clock the schedules see
ENV_CLOCK_OFFSET_FILE = "CORRAL_TEST_CLOCK_OFFSET_FILE"
# tests only (an injected fault): the supervisor's loop takes no spawn orders, as
# if it died between a fire's fact and its spawn
ENV_HOLD_SPAWNS = "CORRAL_TEST_SCHEDULE_HOLD_SPAWNS"
MAX_SLOTS_PER_TICK = 100_000  # a cron walk over a long downtime is bounded
MAX_RESPONSE_BYTES = 64 * 1024
BACKOFF_CAP_S = 30.0
# the hooks' watermark is recorded at most this often: after a restart at most
# this much of the agents' streams is read again (nothing is delivered twice)
WATERMARK_EVERY_S = 10.0


def clock() -> float:
    """The wall clock the schedules follow (UTC seconds)."""
    path = os.environ.get(ENV_CLOCK_OFFSET_FILE)
    offset = 0.0
    if path:
        with contextlib.suppress(OSError, ValueError):
            offset = float(Path(path).read_text().strip() or 0)
    return time.time() + offset


@dataclass(frozen=True)
class SpawnOrder:
    name: str
    task: str
    backend: str
    model: str | None
    schedule: str
    creator: str | None = None  # an agent's schedule: its owner (automationgrants.py)
    budget: dict[str, Any] | None = None  # what is left of the owner's budget


class _Registry:
    """Re-reads one registry's newest generation (actors/registries/store.py)
    when a newer one is written; keeps the last good one."""

    def __init__(self, state_dir: StateDir, registry: str,
                 loader: Callable[[StateDir], dict[str, Any]]) -> None:
        self.state_dir = state_dir
        self.registry = registry
        self.loader = loader
        self.entries: dict[str, Any] = {}
        self._seq: int | None = None

    def refresh(self) -> dict[str, Any]:
        seq = store.newest_seq(self.state_dir, self.registry)
        if seq != self._seq:
            self._seq = seq
            try:
                self.entries = self.loader(self.state_dir)
                log.info("registry_loaded", registry=self.registry, generation_seq=seq,
                         entries=len(self.entries))
            except store.RegistryError as exc:
                log.error("registry_refused", registry=self.registry, generation_seq=seq,
                          reason=str(exc)[:500])
        return self.entries


# --- schedules --------------------------------------------------------------------
def slot_name(schedule: str, slot: float) -> str:
    return f"{schedule}-{time.strftime('%Y%m%d%H%M%S', time.gmtime(slot))}"


@dataclass
class Due:
    """What a schedule should do now (pure: `due_slots`)."""

    fire: float | None = None  # the slot to fire
    catchup: bool = False  # the fired slot is a missed one (policy run_once)
    skipped: list[float] = field(default_factory=list)  # missed slots recorded as skipped
    missed: int = 0  # missed slots covered by the fire


def due_slots(entry: registries.ScheduleEntry, anchor: float, now: float,
              grace_s: float) -> Due:
    """The slots after `anchor` up to `now`: the newest live one (within
    `grace_s`) fires; older ones were missed and follow the entry's policy."""
    it = croniter(entry.cron, anchor)
    slots: list[float] = []
    nxt = float(it.get_next(float))
    while nxt <= now and len(slots) < MAX_SLOTS_PER_TICK:
        slots.append(nxt)
        nxt = float(it.get_next(float))
    due = Due()
    if not slots:
        return due
    live = [s for s in slots if now - s <= grace_s]
    missed = [s for s in slots if now - s > grace_s]
    if missed and entry.missed == "skip":
        due.skipped = missed
    if live:
        due.fire, due.missed = live[-1], (len(missed) if entry.missed == "run_once" else 0)
    elif missed and entry.missed == "run_once":
        due.fire, due.catchup, due.missed = missed[-1], True, len(missed)
    return due


def prepare_pipeline_run(state_dir: StateDir, entry: registries.ScheduleEntry,
                         runner: str) -> Path:
    """The run file of a pipeline schedule's slot, as `supervisor pipeline run`
    writes it: the pipeline (an installed one by name, or an absolute file
    path), checked with its inputs. Written once: a tick retried after the
    fact's reply was lost keeps the file the fact was recorded with."""
    from actors.agent import catalog  # noqa: PLC0415
    from actors.pipelines import runfile  # noqa: PLC0415

    catalog.install()  # the ops a pipeline's steps may name

    path = runfile.path_for(state_dir, runner)
    if path.exists():
        runfile.read(path).parsed()
        return path
    target = entry.pipeline or ""
    if not target.startswith("/"):  # never a file relative to the supervisor's cwd
        gen = store.newest(state_dir, "pipelines")
        installed = gen.get(target)
        if installed is None:
            raise LookupError(f"no installed pipeline {target!r} "
                              f"(installed: {', '.join(gen.names()) or 'none'})")
        text, source = str(installed["text"]), f"registry:{target}@{gen.seq}"
    else:
        text, source = store.pipeline_source(state_dir, target)
    run = runfile.RunFile(pipeline="", source=source, text=text, inputs=entry.inputs)
    pipeline = run.parsed()
    runfile.check_inputs(pipeline, entry.inputs)
    return runfile.write(state_dir, runner,
                         run.model_copy(update={"pipeline": pipeline.name}))


class Scheduler:
    def __init__(self, state_dir: StateDir, config: AutomationConfig,
                 spawns: queue.Queue[SpawnOrder]) -> None:
        self.state_dir = state_dir
        self.config = config
        self.spawns = spawns
        self.registry = _Registry(state_dir, "schedules", store.load_schedules)
        self.anchors: dict[str, float] = {}
        self.last_fire: dict[str, dict[str, Any]] = {}
        self.charges = grants.Charges(state_dir)

    def recover(self, writer: WriterClient) -> None:
        for record in writer.read_stream(SCHEDULES_STREAM):
            p = record.payload()
            if not isinstance(p, dict) or not isinstance(p.get("schedule"), str):
                continue
            name = p["schedule"]
            if record.event == "schedule_armed":
                self.anchors.setdefault(name, float(p["since"]))
            elif record.event in ("schedule_fired", "schedule_skipped"):
                slot = float(p["slot"] if record.event == "schedule_fired" else p["through"])
                self.anchors[name] = max(self.anchors.get(name, slot), slot)
                if record.event == "schedule_fired":
                    self.last_fire[name] = p
                    self.charges.fired(p)
            elif record.event == grants.CHARGED_EVENT:
                self.charges.charged(p)
        for p in self.last_fire.values():  # fired, then the supervisor died before the spawn
            if p.get("started") and p.get("agent") and p.get("task") and not (
                    self.state_dir.config_dir / "agents" / f"{p['agent']}.json").exists():
                log.info("schedule_spawn_resumed", schedule=p["schedule"], agent=p["agent"])
                self.spawns.put(SpawnOrder(p["agent"], p["task"], p.get("backend", "scripted"),
                                           p.get("model"), p["schedule"], p.get("creator"),
                                           p.get("budget")))

    def tick(self, writer: WriterClient, now: float) -> None:
        for entry in self.registry.refresh().values():
            if not entry.enabled:
                continue
            anchor = self.anchors.get(entry.name)
            if anchor is None:
                writer.append(SCHEDULES_STREAM, "schedule_armed",
                              {"schedule": entry.name, "since": now, "cron": entry.cron},
                              key=f"arm:{entry.name}")
                self.anchors[entry.name] = now
                log.info("schedule_armed", schedule=entry.name, cron=entry.cron)
                continue
            due = due_slots(entry, anchor, now, self.config.catchup_grace_s)
            if due.skipped:
                through = due.skipped[-1]
                writer.append(SCHEDULES_STREAM, "schedule_skipped", {
                    "schedule": entry.name, "count": len(due.skipped),
                    "first": due.skipped[0], "through": through, "policy": entry.missed,
                }, key=f"skip:{entry.name}:{int(through)}")
                self.anchors[entry.name] = through
                log.info("schedule_skipped", schedule=entry.name, count=len(due.skipped))
            if due.fire is not None:
                self._fire(writer, entry, due, now)
        self.charges.tick(writer)

    def _fire(self, writer: WriterClient, entry: registries.ScheduleEntry, due: Due,
              now: float) -> None:
        assert due.fire is not None
        slot = due.fire
        payload: dict[str, Any] = {
            "schedule": entry.name, "slot": slot,
            "slot_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(slot)),
            "fired_at": now, "action": entry.action, "catchup": due.catchup,
            "missed": due.missed, "cron": entry.cron, "owner": entry.owner,
        }
        try:  # an agent's schedule: its owner's grants and what is left of its budget
            grant = grants.grant_for(writer, self.state_dir, entry.owner)
        except grants.GrantRefusedError as exc:
            grant = None
            payload.update(agent=slot_name(entry.name, slot), started=False,
                           reason=str(exc)[:500])
        if grant is not None and entry.action == "spawn":
            payload.update(agent=slot_name(entry.name, slot), task=entry.task,
                           backend=entry.backend, model=entry.model, started=True)
        elif grant is not None:
            runner = slot_name(entry.name, slot)
            payload.update(pipeline=entry.pipeline, inputs=entry.inputs, runner=runner)
            try:  # the run file before the fact: a restart after the fact finds it
                run_path = prepare_pipeline_run(self.state_dir, entry, runner)
            except (CorralError, LookupError, OSError, ValueError) as exc:
                payload.update(started=False, reason=str(exc).splitlines()[0][:500])
            else:
                payload.update(agent=runner, task=str(run_path), backend="pipeline",
                               model=None, started=True)
        if grant is not None and payload["started"]:
            payload.update(creator=grant.creator, budget=grant.budget)
        writer.append(SCHEDULES_STREAM, "schedule_fired", payload,
                      key=f"fire:{entry.name}:{int(slot)}")
        self.charges.fired(payload)
        self.anchors[entry.name] = slot
        self.last_fire[entry.name] = payload
        log.info("schedule_fired", schedule=entry.name, slot=payload["slot_utc"],
                 catchup=due.catchup, action=entry.action)
        if payload["started"]:
            self.spawns.put(SpawnOrder(payload["agent"], payload["task"], payload["backend"],
                                       payload["model"], entry.name, payload["creator"],
                                       payload["budget"]))
        elif grant is None:
            log.warning("schedule_run_refused", schedule=entry.name, owner=entry.owner,
                        reason=payload["reason"])
        else:
            log.warning("schedule_pipeline_refused", schedule=entry.name,
                        pipeline=entry.pipeline, reason=payload["reason"])


# --- hooks ------------------------------------------------------------------------
@dataclass(frozen=True)
class HookEvent:
    event: str
    event_id: str  # unique per event: the source record's seq, or a name and time
    body: dict[str, Any]


def events_of(stream: str, record_event: str, seq: int, ts: float,
              payload: Any) -> HookEvent | None:
    """The hook event a WAL record is, if any."""
    if not isinstance(payload, dict):
        return None
    who = stream.split("/", 1)[1]
    base: dict[str, Any] = {"stream": stream, "seq": seq, "ts": ts}  # ts: unix seconds
    if stream.startswith("agent/"):
        if record_event == "approval_requested":
            detail = {k: payload.get(k) for k in ("request", "call_id", "op", "pattern", "kind")}
            return HookEvent("approval_requested", str(seq),
                             {**base, "agent": who, "detail": detail})
        if record_event == "session_exit":
            kind = "budget_paused" if payload.get("reason") == "budget" else "agent_finished"
            detail = {"reason": payload.get("reason"),
                      "summary": str(payload.get("summary") or "")[:1000]}
            return HookEvent(kind, str(seq), {**base, "agent": who, "detail": detail})
    elif stream.startswith("subagents/") and record_event == "subagent_ended":
        detail = {k: payload.get(k) for k in ("subagent_id", "status", "files", "exit_code")}
        return HookEvent("changeset_ready", str(seq), {**base, "agent": who, "detail": detail})
    return None


def loopback_or_allowed(url: str, allowed: list[str]) -> str | None:
    """None when `url` may be posted to; else why not."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        return f"not an http(s) URL: {url[:100]}"
    if host in allowed or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return f"host {host} is neither loopback nor in automation.hook_allow_hosts"


def post_once(url: str, body: bytes, delivery: str, timeout_s: float) -> tuple[bool, str]:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=timeout_s)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("POST", path, body=body, headers={
            "Content-Type": "application/json", "Idempotency-Key": delivery,
            "User-Agent": "corral-hooks"})
        response = conn.getresponse()
        response.read(MAX_RESPONSE_BYTES)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        return 200 <= response.status < 300, f"http {response.status}"
    finally:
        conn.close()


class Hooks:
    def __init__(self, state_dir: StateDir, config: AutomationConfig,
                 keyring: auth.Keyring) -> None:
        self.state_dir = state_dir
        self.config = config
        self.keyring = keyring
        self.registry = _Registry(state_dir, "hooks", store.load_hooks)
        self.due: dict[str, dict[str, Any]] = {}  # delivery -> hook_due payload (no outcome yet)
        self.known: set[str] = set()  # every delivery recorded due
        self.watermark: int | None = None
        self.watermark_at = 0.0
        self.base: int | None = None  # where streams not watched yet are read from
        self.recorded = False  # a watermark is in the WAL (none is written before a hook)
        self.cursors: dict[str, int] = {}
        self.http_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hook-http")
        self.command_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hook-cmd")
        self.in_flight: dict[str, Future[dict[str, Any]]] = {}
        self.closing = threading.Event()
        self._command_local = threading.local()

    def recover(self, writer: WriterClient) -> None:
        for record in writer.read_stream(HOOKS_STREAM):
            p = record.payload()
            if not isinstance(p, dict):
                continue
            if record.event == "hook_due" and isinstance(p.get("delivery"), str):
                self.known.add(p["delivery"])
                self.due[p["delivery"]] = p
            elif record.event in ("hook_delivered", "hook_failed"):
                self.due.pop(str(p.get("delivery")), None)
            elif record.event == "hooks_watermark" and isinstance(p.get("seq"), int):
                self.watermark = max(self.watermark or 0, p["seq"])
                self.recorded = True
        if self.due:
            log.info("hook_deliveries_resumed", count=len(self.due))

    def tick(self, writer: WriterClient, agents_now: Callable[[], frozenset[str]],
             gave_up: list[tuple[str, str, str, float]]) -> None:
        hooks = {n: h for n, h in self.registry.refresh().items() if h.enabled}
        self._settle(writer)
        if self.watermark is None:  # the first start: history before it fires nothing
            head = writer.read_page(HOOKS_STREAM, 1, 1).head_seq
            if hooks:
                writer.append(HOOKS_STREAM, "hooks_watermark", {"seq": head}, key=f"wm:{head}")
                self.recorded = True
            self.watermark, self.watermark_at = head, time.monotonic()
            log.info("hooks_watermark_started", seq=head)
        events: list[HookEvent] = []
        if self.base is None:
            self.base = self.watermark
        # the head first, the names after: every record at or below the head was
        # appended by an agent already named (names are set before an agent runs)
        round_head = writer.read_page(HOOKS_STREAM, 1, 1).head_seq
        agents = agents_now()
        if not hooks:  # nothing listens: skip the streams, only move the watermark
            self.cursors.clear()
            self.base = round_head
            agents = frozenset()
        for name in sorted(agents):
            for stream in (f"agent/{name}", f"subagents/{name}"):
                # a stream first watched now (an agent spawned since) is read from
                # the base: its records may be older than the moving watermark
                cursor = self.cursors.get(stream, self.base + 1)
                while True:
                    page = writer.read_page(stream, cursor, 256)
                    for line in page.records:
                        rec = _parse(line)
                        if rec is None:
                            continue
                        event = events_of(stream, rec.event, rec.seq, rec.ts, rec.payload())
                        if event is not None:
                            events.append(event)
                    cursor = page.next_seq
                    if not page.more:
                        break
                self.cursors[stream] = cursor
        for child, kind, reason, at in gave_up:
            events.append(HookEvent("child_gave_up", f"gaveup:{child}:{int(at * 1000)}", {
                "stream": None, "seq": None,
                "ts": at,
                "agent": child if kind == "agent" else None,
                "detail": {"child": child, "kind": kind, "reason": reason}}))
        for event in events:
            for hook in hooks.values():
                if event.event not in hook.on:
                    continue
                delivery = f"{hook.name}:{event.event_id}"
                if delivery in self.known:
                    continue
                payload = {"delivery": delivery, "hook": hook.name, "event": event.event,
                           "body": {"id": delivery, "hook": hook.name, "event": event.event,
                                    **event.body}}
                writer.append(HOOKS_STREAM, "hook_due", payload, key=f"due:{delivery}")
                self.known.add(delivery)
                self.due[delivery] = payload
        for delivery, payload in list(self.due.items()):
            if delivery not in self.in_flight:
                hook = hooks.get(payload["hook"])
                if hook is None:  # removed or disabled since: recorded, not delivered
                    self._record(writer, delivery, payload, "hook_failed", {
                        "attempts": 0, "error": "the hook is no longer installed"})
                    continue
                self._submit(delivery, payload, hook)
        if round_head > self.watermark and (hooks or self.recorded) and \
                time.monotonic() - self.watermark_at >= WATERMARK_EVERY_S:
            writer.append(HOOKS_STREAM, "hooks_watermark", {"seq": round_head},
                          key=f"wm:{round_head}")
            self.recorded = True
            self.watermark, self.watermark_at = round_head, time.monotonic()
        elif not hooks and not self.recorded:  # never recorded: nothing to catch up on
            self.watermark = round_head

    def _submit(self, delivery: str, payload: dict[str, Any],
                hook: registries.HookEntry) -> None:
        body = json.dumps(payload["body"], separators=(",", ":"), default=str).encode()
        if hook.url is not None:
            self.in_flight[delivery] = self.http_pool.submit(self._deliver_http, hook, body,
                                                             delivery)
        else:
            self.in_flight[delivery] = self.command_pool.submit(self._deliver_command, hook,
                                                                body, delivery)

    def _settle(self, writer: WriterClient) -> None:
        for delivery, future in list(self.in_flight.items()):
            if not future.done():
                continue
            del self.in_flight[delivery]
            try:
                outcome = future.result()
            except Exception as exc:  # noqa: BLE001 - a worker's bug is a failed delivery
                outcome = {"ok": False, "attempts": 0, "error": f"{type(exc).__name__}"}
            payload = self.due.get(delivery)
            if payload is None:
                continue
            event = "hook_delivered" if outcome.pop("ok") else "hook_failed"
            self._record(writer, delivery, payload, event, outcome)

    def _record(self, writer: WriterClient, delivery: str, payload: dict[str, Any],
                event: str, outcome: dict[str, Any]) -> None:
        writer.append(HOOKS_STREAM, event, {"delivery": delivery, "hook": payload["hook"],
                                            "event": payload["event"], **outcome},
                      key=f"done:{delivery}")
        self.due.pop(delivery, None)
        log.info(event, delivery=delivery, **{k: v for k, v in outcome.items()
                                               if k in ("attempts", "error", "status")})

    def _attempts(self, hook: registries.HookEntry,
                  once: Callable[[], tuple[bool, str]]) -> dict[str, Any]:
        started = time.monotonic()
        status = ""
        attempt = 0
        for attempt in range(1, hook.retries + 2):
            ok, status = once()
            if ok:
                return {"ok": True, "attempts": attempt, "status": status,
                        "ms": round((time.monotonic() - started) * 1000, 1)}
            if attempt <= hook.retries:
                delay = min(BACKOFF_CAP_S, hook.backoff_s * 2 ** (attempt - 1))
                if self.closing.wait(delay):
                    break
        return {"ok": False, "attempts": attempt, "error": status,
                "ms": round((time.monotonic() - started) * 1000, 1)}

    def _deliver_http(self, hook: registries.HookEntry, body: bytes,
                      delivery: str) -> dict[str, Any]:
        assert hook.url is not None
        url = hook.url
        refusal = loopback_or_allowed(url, self.config.hook_allow_hosts)
        if refusal is not None:
            return {"ok": False, "attempts": 0, "error": refusal}
        return self._attempts(hook, lambda: post_once(url, body, delivery, hook.timeout_s))

    def _deliver_command(self, hook: registries.HookEntry, body: bytes,
                         delivery: str) -> dict[str, Any]:
        from actors.procs.client import ProcsClient  # noqa: PLC0415
        from broker.peer import BrokerPeer  # noqa: PLC0415

        local = self._command_local
        if getattr(local, "client", None) is None:
            local.ctx = zmq.Context()
            local.peer = BrokerPeer(local.ctx, self.state_dir, ACTOR,
                                    credential=self.keyring.credential(ACTOR))
            local.client = ProcsClient(local.peer, ACTOR, timeout_s=5.0)
        client = local.client
        workspace = self.state_dir.agent_dir(ACTOR) / "workspace"
        workspace.mkdir(parents=True, exist_ok=True)
        assert hook.command is not None
        command = f"export CORRAL_HOOK_EVENT={shlex.quote(body.decode())}\n{hook.command}"
        tries = {"n": 0}

        def once() -> tuple[bool, str]:
            tries["n"] += 1
            try:
                out = client.bash(command, str(workspace), timeout_s=hook.timeout_s,
                                  msg_id=f"hook.{abs(hash(delivery)) % 10**12}.{tries['n']}"
                                  f".{int(time.time() * 1000) % 10**9}")
            except Exception as exc:  # noqa: BLE001 - procs down, refused: a failed attempt
                return False, f"{type(exc).__name__}: {str(exc)[:200]}"
            return out.exit_code == 0, f"exit {out.exit_code} ({out.state})"

        return self._attempts(hook, once)

    def close(self) -> None:
        self.closing.set()
        self.http_pool.shutdown(wait=False, cancel_futures=True)
        self.command_pool.shutdown(wait=False, cancel_futures=True)


def _parse(line: bytes) -> Any:
    from actors.writer.wal import parse_record  # noqa: PLC0415

    return parse_record(line + b"\n")


# --- the thread and the supervisor's side ------------------------------------------
class Automation:
    def __init__(self, state_dir: StateDir, config: AutomationConfig,
                 keyring: auth.Keyring) -> None:
        self.state_dir = state_dir
        self.config = config
        self.keyring = keyring
        self.spawns: queue.Queue[SpawnOrder] = queue.Queue()
        self.gave_up: queue.Queue[tuple[str, str, str, float]] = queue.Queue()
        self.agents: frozenset[str] = frozenset()  # set by the supervisor's loop (`service`)
        self.children_seen = -1
        self.names_due = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="automation", daemon=True)

    def start(self) -> None:
        if self.config.enabled:
            self._thread.start()

    def child_gave_up(self, name: str, kind: str, reason: str) -> None:
        self.gave_up.put((name, kind, reason, time.time()))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread (it finishes the tick it is in: bounded by the writer
        client's deadline); wait for it at most `timeout_s` (it is a daemon)."""
        self._stop.set()
        if timeout_s > 0 and self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        from actors.writer.client import WriterClient  # noqa: PLC0415

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        writer = WriterClient(ctx, self.state_dir, ACTOR, timeout_s=2.0, retries=1,
                              credential=self.keyring.credential(ACTOR))
        scheduler = Scheduler(self.state_dir, self.config, self.spawns)
        hooks = Hooks(self.state_dir, self.config, self.keyring)
        recovered = False
        pending_gave_up: list[tuple[str, str, str, float]] = []
        try:
            while not self._stop.is_set():
                try:
                    if not recovered:
                        writer.ping(timeout_s=1.0, retries=0)
                        scheduler.recover(writer)
                        hooks.recover(writer)
                        recovered = True
                        log.info("automation_started")
                    scheduler.tick(writer, clock())
                    while True:
                        try:
                            pending_gave_up.append(self.gave_up.get_nowait())
                        except queue.Empty:
                            break
                    hooks.tick(writer, lambda: self.agents, pending_gave_up)
                    pending_gave_up = []
                except Exception as exc:  # noqa: BLE001 - the writer restarts, a bad file: go on
                    log.warning("automation_tick_failed",
                                error=f"{type(exc).__name__}: {exc}"[:300])
                    if not recovered:
                        scheduler = Scheduler(self.state_dir, self.config, self.spawns)
                        hooks.close()
                        hooks = Hooks(self.state_dir, self.config, self.keyring)
                    self._stop.wait(0.5)
                self._stop.wait(self.config.tick_s)
        finally:
            hooks.close()
            writer.close()
            ctx.destroy(linger=0)


class _Runtime(RuntimeFace, Protocol):
    """What `service` needs of the running supervisor (supervisor/runtime/loop.py)."""

    automation: Automation


def service(rt: _Runtime, now: float) -> None:
    """Once per supervisor loop turn: hand the thread the agents' names, and
    spawn what the schedules fired (the supervisor's own spawn path)."""
    from actors.kernel.settings import Budget  # noqa: PLC0415
    from supervisor.runtime import requests  # noqa: PLC0415

    auto = rt.automation
    if len(rt.children) != auto.children_seen or now >= auto.names_due:
        # the agents' names, when the children changed (or once a second)
        auto.children_seen, auto.names_due = len(rt.children), now + 1.0
        auto.agents = frozenset(n for n, c in rt.children.items() if c.kind == "agent")
    while not os.environ.get(ENV_HOLD_SPAWNS):
        try:
            order = auto.spawns.get_nowait()
        except queue.Empty:
            return
        message = protocol.SpawnRequest(msg_id=f"sched.{int(now * 1000) % 10**12}",
                                        name=order.name, task=order.task,
                                        backend=order.backend,  # type: ignore[arg-type]
                                        model=order.model)
        reply = requests.spawn(rt, message, now, creator=order.creator,
                               budget=None if order.budget is None
                               else Budget.model_validate(order.budget))
        if isinstance(reply, protocol.Error):
            log.warning("schedule_spawn_refused", schedule=order.schedule, agent=order.name,
                        reason=reply.detail)
        else:
            log.info("schedule_spawned", schedule=order.schedule, agent=order.name)
        auto.agents = frozenset(n for n, c in rt.children.items() if c.kind == "agent")
        auto.children_seen = len(rt.children)
