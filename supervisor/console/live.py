"""One status poller for every open page, fanned out as server-sent events.

A listener that does not keep up is dropped (the page reconnects). See
docs/console.md ("Where the data comes from").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread

from broker.statedir import StateDir
from supervisor import statusclient
from supervisor.console import views

POLL_S = 0.25
LINGER_S = 30.0
FULL_EVERY_S = 5.0
KEEPALIVE_S = 15.0
LISTENER_QUEUE = 64


def frame(event: str, data: Any) -> bytes:
    """One server-sent event; JSON data on one line."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Hub:
    """The poller and its listeners."""

    def __init__(self, state_dir: StateDir, poll_s: float = POLL_S) -> None:
        self.state_dir = state_dir
        self.poll_s = poll_s
        self.listeners: set[asyncio.Queue[bytes | None]] = set()
        self.rows: dict[str, dict[str, Any]] = {}
        self.queue: list[dict[str, Any]] = []
        self.down: str | None = None
        self._queue_key: tuple[tuple[Any, ...], ...] = ()
        self._linger_until = 0.0
        self.limits = views.BudgetLimits(state_dir)
        self._task: asyncio.Task[None] | None = None

    # --- listeners ----------------------------------------------------------------
    async def listen(self) -> AsyncIterator[bytes]:
        """The event stream of one page."""
        mine: asyncio.Queue[bytes | None] = asyncio.Queue(LISTENER_QUEUE)
        self.listeners.add(mine)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            if self.rows:
                yield frame("agents", list(self.rows.values()))
                yield frame("queue", self.queue)
            if self.down is not None:
                yield frame("down", {"reason": self.down})
            while True:
                try:
                    item = await asyncio.wait_for(mine.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                if item is None:
                    return  # too slow: the page reconnects
                yield item
        finally:
            self.listeners.discard(mine)
            self._linger_until = time.monotonic() + LINGER_S

    def _send(self, data: bytes) -> None:
        for q in list(self.listeners):
            try:
                q.put_nowait(data)
            except asyncio.QueueFull:
                self.listeners.discard(q)
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
                q.put_nowait(None)

    # --- the poller ---------------------------------------------------------------
    async def _run(self) -> None:
        last_full = 0.0
        while self.listeners or time.monotonic() < self._linger_until:
            started = time.monotonic()
            try:
                rows = await anyio.to_thread.run_sync(views.status_rows, self.state_dir,
                                                      self.limits)
            except (statusclient.NoAnswerError, statusclient.RefusedError, OSError) as exc:
                reason = f"no answer from the supervisor of {self.state_dir.root}: {exc}"
                if self.down != reason:
                    self.down = reason
                    self._send(frame("down", {"reason": reason}))
            except Exception as exc:  # noqa: BLE001 - a bad reply never ends the poller
                self._send(frame("down", {"reason": f"unreadable status: {exc!r}"[:500]}))
            else:
                if self.down is not None:
                    self.down = None
                    self._send(frame("up", {}))
                try:
                    await self._update(rows, started - last_full >= FULL_EVERY_S)
                except Exception as exc:  # noqa: BLE001 - a bad reply never ends the poller
                    self._send(frame("down", {"reason": f"unreadable status: {exc!r}"[:500]}))
                if started - last_full >= FULL_EVERY_S:
                    last_full = started
            # a status request costs the supervisor's loop about what it costs here:
            # at most a third of its time goes to the console, however loaded it is
            spent = time.monotonic() - started
            await asyncio.sleep(max(self.poll_s - spent, 2 * spent))
        self._task = None

    async def _update(self, rows: list[dict[str, Any]], full: bool) -> None:
        moved, gone = views.changed(self.rows, rows)
        self.rows = {r["name"]: r for r in rows}
        if full:
            self._send(frame("agents", rows))
        elif moved or gone:
            self._send(frame("delta", {"rows": moved, "gone": gone}))
        key = tuple(sorted((r["name"], r["waiting"], r["turn"])
                           for r in rows if r["kind"] == "agent" and r["waiting"]))
        if key != self._queue_key:
            names = [name for name, _, _ in key]
            found = await anyio.to_thread.run_sync(views.pending, self.state_dir, names)
            self._queue_key = key
            self.queue = found
            self._send(frame("queue", found))

    async def refresh_queue(self) -> list[dict[str, Any]]:
        """The queue now, from a fresh status (a page's first look, or after an
        answer from the page: no wait for the next poll)."""
        try:
            reply = await anyio.to_thread.run_sync(views.status, self.state_dir)
        except (statusclient.NoAnswerError, statusclient.RefusedError, OSError):
            return self.queue  # the poller says `down`
        names = [r["name"] for r in views.rows(reply) if r["kind"] == "agent" and r["waiting"]]
        self.queue = await anyio.to_thread.run_sync(views.pending, self.state_dir, names)
        self._queue_key = ()
        self._send(frame("queue", self.queue))
        return self.queue
