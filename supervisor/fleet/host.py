"""A host supervisor's part in the fleet: its status entry and control requests.

Nothing here ever stops the supervisor. See docs/fleet.md ("One view").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import structlog

from broker.durable import write_atomic
from broker.statedir import StateDir
from supervisor.fleet import beat, operatorsig
from supervisor.fleet.adopt import Uploader
from supervisor.fleet.natsclient import (
    HOSTS_BUCKET,
    connect_options,
    control_subject,
    settings_of,
)
from supervisor.fleet.place import (
    PLACE_HOST,
    PLACE_QUEUE,
    PLACE_SUBJECT,
    agents_of,
    decide,
    place_subject,
)
from supervisor.fleet.view import read_hosts
from supervisor.fleet.watch import Watch
from supervisor.fleetconfig import FleetConfig

log = structlog.get_logger("supervisor.fleet")

BUCKET = HOSTS_BUCKET
CONTROL_VERBS = frozenset({"kill", "stop", "start"})


def write_fleet_file(state_dir: StateDir, config: FleetConfig) -> Path:
    """run/fleet.json: how this host reaches the cluster (paths, never secrets)."""
    path = state_dir.run_dir / "fleet.json"
    data = config.model_dump(mode="json")
    write_atomic(path, json.dumps(data).encode())
    return path


async def ensure_bucket(js: Any, config: FleetConfig) -> Any:
    from nats.js.api import KeyValueConfig, StorageType  # noqa: PLC0415
    from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(
            bucket=BUCKET, history=1, ttl=config.host_ttl_s, replicas=config.replicas,
            storage=StorageType.FILE))


class FleetHost:
    def __init__(self, config: FleetConfig, state_dir: StateDir) -> None:
        assert config.host is not None
        self.config = config
        self.host = config.host
        self.state_dir = state_dir
        self._status: dict[str, Any] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-host",
                                        daemon=True)
        self._task: asyncio.Future[None] | None = None
        self._wake = asyncio.Event()
        self._seen = operatorsig.Nonces()  # nonce -> when (replays refused, also across
        # a restart: a request signed before this supervisor started is refused)
        self._placed: set[str] = set()  # agents accepted by placement, not yet in a status
        self._placing = asyncio.Lock()  # one placement at a time (two subjects)
        self._js: Any = None
        self.published_total = 0
        self.watch: Watch | None = None
        self.uploader: Uploader | None = None

    def start(self) -> None:
        write_fleet_file(self.state_dir, self.config)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self._loop)  # type: ignore[assignment]

    def update(self, status: dict[str, Any]) -> None:
        """The supervisor's newest status (called at every status interval)."""
        self._status = status
        self._loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # --- on the loop ----------------------------------------------------------
    async def _main(self) -> None:
        import nats  # noqa: PLC0415 - the fleet extra

        options = connect_options(settings_of(self.config), f"corral-host-{self.host}")
        while True:
            try:
                nc = await nats.connect(**options)
                break
            except Exception as exc:  # noqa: BLE001 - the cluster is away: try again
                log.warning("fleet_connect_failed", error=type(exc).__name__)
                await asyncio.sleep(1)
        try:
            js = nc.jetstream(timeout=5)
            kv = None
            beater: beat.Beat | None = None
            await nc.subscribe(control_subject(self.host), cb=self._on_control)
            self._js = js
            if self._operator_key() is not None:  # without it control is off: a
                # member that could only refuse would turn placements away from the group
                await nc.subscribe(PLACE_SUBJECT, queue=PLACE_QUEUE, cb=self._on_place)
                await nc.subscribe(place_subject(self.host), cb=self._on_place)
            watch = Watch(self.host, self.config.dead_grace_s, self.config.replicas,
                          self.state_dir)
            uploader = Uploader(self.host, self.state_dir, self.config.replicas)
            self.uploader = uploader
            self.watch = watch
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.config.host_ttl_s / 3)
                self._wake.clear()
                status = self._status
                if status is None:
                    continue
                try:
                    if kv is None:
                        kv = await ensure_bucket(js, self.config)
                    if not watch.registered and not await watch.register(js):
                        return  # declared dead: this host reports nothing more
                    if beater is None:  # the status entry, kept alive apart (beat.py)
                        beater = beat.start(self, kv)
                    await beater.put_now()
                    await uploader.sync(js)  # the agents' bundles (adopt.py)
                    await watch.check(js, kv, await read_hosts(js, self.config.host_ttl_s))
                except Exception as exc:  # noqa: BLE001 - stale until the cluster is back
                    log.warning("fleet_status_put_failed", error=type(exc).__name__)
        finally:
            if beater is not None:
                await beater.stop()
            with contextlib.suppress(Exception):
                await nc.close()

    async def _on_control(self, msg: Any) -> None:
        from supervisor.fleet import ctl  # noqa: PLC0415

        try:
            request = ctl.verify(msg.data, self.host, self._operator_key(), self._seen)
        except ctl.FleetControlError as exc:
            log.warning("fleet_control_refused", reason=str(exc)[:200])
            await msg.respond(json.dumps({"ok": False, "error": "forbidden",
                                          "detail": str(exc)}).encode())
            return
        log.info("fleet_control", verb=request["verb"], agent=request["agent"])
        reply = await asyncio.get_running_loop().run_in_executor(
            None, ctl.carry_out, self.state_dir, request)
        await msg.respond(json.dumps(reply).encode())

    async def _on_place(self, msg: Any) -> None:
        """A placement from the queue group (supervisor/fleet/place.py): accepted
        and spawned here only when this host is a least-loaded live host."""
        from supervisor.fleet import ctl  # noqa: PLC0415

        def answer(reply: dict[str, Any]) -> Any:
            return msg.respond(json.dumps({**reply, "host": self.host}).encode())

        try:
            request = ctl.verify(msg.data, PLACE_HOST, self._operator_key(), self._seen)
        except ctl.FleetControlError as exc:
            request = {"refused": str(exc)}
        if request.get("verb") != "spawn":
            why = request.get("refused") or "only spawn is placed"
            log.warning("fleet_place_refused", reason=str(why)[:200])
            await answer({"ok": False, "error": "forbidden", "detail": why})
            return
        async with self._placing:
            await self._place(request, answer)

    async def _place(self, request: dict[str, Any], answer: Any) -> None:
        from supervisor.fleet import ctl  # noqa: PLC0415

        if self._status is None or self.watch is None or not self.watch.registered:
            await answer({"ok": False, "error": "declined", "detail": "not in the fleet yet"})
            return
        children = self._status.get("children", [])
        running = agents_of(children)
        self._placed -= {str(c.get("name")) for c in children}  # in a status now: counted there
        try:
            view = await read_hosts(self._js, self.config.host_ttl_s)
        except Exception as exc:  # noqa: BLE001 - the view unreadable: let another host try
            await answer({"ok": False, "error": "declined", "detail": type(exc).__name__})
            return
        accept, why, least = decide(self.host, running | self._placed, view,
                                    self.config.max_agents)
        if not accept:
            log.info("fleet_place_declined", agent=request["agent"], why=why)
            await answer({"ok": False, "error": "declined", "detail": why, "least": least})
            return
        log.info("fleet_placed", agent=request["agent"], why=why)
        reply = await asyncio.get_running_loop().run_in_executor(
            None, ctl.carry_out, self.state_dir, request)
        if reply.get("ok"):
            self._placed.add(request["agent"])
        await answer({**reply, "placed": True})

    def _operator_key(self) -> str | None:
        """The operator's public key (hex), or None: fleet control is off."""
        path = self.config.operator_public_key
        if path is None:
            return None
        try:
            return operatorsig.load_public(Path(path))
        except (OSError, ValueError) as exc:
            log.warning("fleet_operator_key_unusable", error=str(exc)[:200])
            return None


def fleet_host(config: FleetConfig, state_dir: StateDir) -> FleetHost | None:
    """The started FleetHost in fleet mode (`fleet.host` set), else None."""
    if not config.enabled:
        return None
    host = FleetHost(config, state_dir)
    host.start()
    return host
