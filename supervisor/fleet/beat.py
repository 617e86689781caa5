"""The host's status entry in `corral_hosts`, kept alive on its own task.

Put every `host_ttl_s / 3` whatever the round is doing, so a long adoption
does not get its adopter fenced. See docs/fleet.md ("Declaring a host dead").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("supervisor.fleet")


class Beat:
    def __init__(self, host: str, kv: Any, status: Callable[[], dict[str, Any] | None],
                 interval_s: float, on_put: Callable[[], None]) -> None:
        self.host = host
        self._kv = kv
        self._status = status
        self._interval_s = interval_s
        self._on_put = on_put
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def put_now(self) -> None:
        """Put the newest status (raises what the put raises)."""
        status = self._status()
        if status is None:
            return
        async with self._lock:
            entry = {**status, "host": self.host, "at": time.time()}
            await self._kv.put(self.host, json.dumps(entry).encode())
        self._on_put()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.put_now()
            except Exception as exc:  # noqa: BLE001 - stale until the cluster is back
                log.warning("fleet_status_put_failed", error=type(exc).__name__)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def start(host: Any, kv: Any) -> Beat:
    """The beat of a `FleetHost` (supervisor/fleet/host.py), started on its loop."""
    def counted() -> None:
        host.published_total += 1

    beat = Beat(host.host, kv, lambda: host._status, host.config.host_ttl_s / 3, counted)
    beat._task = asyncio.get_running_loop().create_task(beat._run())
    return beat
