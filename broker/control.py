"""The child side of supervision: `ready`, then heartbeats with counters.

Plain mode (`tick()` from the actor's loop) or a pulse thread that beats only
while the main thread shows life; an idle actor (`with reporter.idle():`)
sends one beat marked idle, then none. A child gets CORRAL_CONTROL (the
endpoint), CORRAL_ACTOR (its DEALER identity) and CORRAL_HEARTBEAT_TIMEOUT_S (the
pulse's `stall_s`); without CORRAL_CONTROL it does nothing.
See docs/supervisor.md ("Liveness") and docs/decisions.md ("Heartbeats come
from a pulse thread in actors that block").
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog
import zmq

from broker import auth, protocol

ENV_CONTROL = "CORRAL_CONTROL"
ENV_ACTOR = "CORRAL_ACTOR"
ENV_HEARTBEAT_TIMEOUT = "CORRAL_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_STALL_S = 10.0  # the default heartbeat.timeout_s

log = structlog.get_logger("broker.control")

Values = dict[str, int | float]


class CallWatch(Protocol):
    """Who hears about an actor's blocking calls (a ControlReporter): while one
    runs, heartbeats go on, up to its deadline."""

    def busy(self, op: str, deadline_s: float) -> contextlib.AbstractContextManager[None]: ...


@dataclass(frozen=True)
class Call:
    """One declared call of the main thread: what, since when, until when (monotonic)."""

    op: str
    since: float
    until: float


def stall_from_env(default: float = DEFAULT_STALL_S) -> float:
    """The pulse's stall allowance: the supervisor's heartbeat timeout, when it says so."""
    raw = os.environ.get(ENV_HEARTBEAT_TIMEOUT, "")
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if value > 0 else default


def shows_life(now: float, last_touch: float, calls: tuple[Call, ...], stall_s: float) -> bool:
    """The watchdog rule: the main thread is alive when it touched within
    `stall_s`, or when a call it declared is still within its deadline plus
    `stall_s` of grace (time to end the call and come back)."""
    if now - last_touch <= stall_s:
        return True
    return any(now <= call.until + stall_s for call in calls)


class ControlReporter:
    """Sends `ready` once and `heartbeat` every `interval_s`, never blocking."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        actor: str,
        interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        *,
        pulse: bool = False,
        stall_s: float = DEFAULT_STALL_S,
        credential: auth.Credential | None = None,
    ) -> None:
        """`credential` defaults to this process's own (broker/auth.py): the
        supervisor takes `ready`/`heartbeat` for `actor` only from `actor`."""
        self.actor = actor
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.pulse = pulse
        self.withheld = 0  # beats the watchdog did not send (the main thread hung)
        self._ctx = ctx
        self._endpoint = endpoint
        self._pid = os.getpid()
        # read here, on the main thread, once: the pulse thread's socket presents it too
        self._credential = credential or auth.default_credential(endpoint)
        self._next_beat = 0.0
        # pulse mode: shared with the thread, under the condition's lock
        self._cond = threading.Condition()
        self._outbox: list[protocol.Ready | protocol.Heartbeat] = []
        self._values: Values = {}
        self._calls: tuple[Call, ...] = ()
        self._last_touch = time.monotonic()
        self._closing = False
        self._idle = False  # the main thread waits for work: no beats (idle())
        self._readied = False  # pulse mode: the thread sends nothing before ready()
        self._linger_ms = 0
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket[bytes] | None = None
        if not pulse:
            self._sock = self._open()

    @classmethod
    def from_env(
        cls, ctx: zmq.Context[zmq.Socket[bytes]], default_actor: str, *, pulse: bool = False,
        interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    ) -> ControlReporter | None:
        endpoint = os.environ.get(ENV_CONTROL)
        if not endpoint:
            return None
        return cls(ctx, endpoint, os.environ.get(ENV_ACTOR, default_actor), interval_s,
                   pulse=pulse, stall_s=stall_from_env())

    def _open(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.actor.encode())
        sock.setsockopt(zmq.SNDHWM, 16)
        if self._credential is not None:
            auth.apply_client(sock, self._credential)
        sock.connect(self._endpoint)
        return sock

    # --- sending -------------------------------------------------------------------
    def _send(self, message: protocol.Ready | protocol.Heartbeat) -> None:
        if self.pulse:
            with self._cond:
                self._outbox.append(message)
                self._cond.notify()
            return
        assert self._sock is not None
        # supervisor busy or gone: liveness is best effort, the work goes on
        with contextlib.suppress(zmq.Again):
            self._sock.send(protocol.encode(message), zmq.NOBLOCK)

    def _heartbeat(self, values: Values, now: float,
                   calls: tuple[Call, ...] | None = None) -> protocol.Heartbeat:
        calls = self._calls if calls is None else calls
        busy = None
        if calls:  # the outermost call is what the actor is busy with
            busy = protocol.Busy(op=calls[0].op, since_s=round(max(0.0, now - calls[0].since), 3))
        return protocol.Heartbeat(actor=self.actor, pid=self._pid, values=values, busy=busy)

    def connect(self) -> None:
        """Pulse mode: start the pulse thread now, so that its connection and
        its authentication are made while the actor goes on starting (an
        agent: its logging, the broker's connection, its rebuild), not after
        `ready()`; it sends nothing before `ready()`."""
        if self.pulse and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()

    def ready(self) -> None:
        self.touch()
        if self.pulse:
            with self._cond:
                self._readied = True
                self._cond.notify()
            self.connect()
        self._send(protocol.Ready(actor=self.actor, pid=self._pid))
        self._next_beat = time.monotonic() + self.interval_s

    def tick(self, values: Callable[[], Values] | None = None) -> None:
        """Plain mode: send a heartbeat if one is due. Pulse mode: show life and,
        once per interval, hand fresh counters to the pulse. Cheap to call on
        every loop turn: the counters are gathered (`values()`) only when due."""
        now = time.monotonic()
        self._last_touch = now
        if now < self._next_beat:
            return
        self._next_beat = now + self.interval_s
        counters = values() if values is not None else {}
        if self.pulse:
            with self._cond:
                self._values = counters
            return
        self._send(self._heartbeat(counters, now))

    def beat(self, values: Values | None = None) -> None:
        """Send a heartbeat now (e.g. a final report just before a clean exit)."""
        now = time.monotonic()
        self._last_touch = now
        self._next_beat = now + self.interval_s
        if self.pulse and values is not None:
            with self._cond:
                self._values = values
        self._send(self._heartbeat(values or {}, now))

    def touch(self) -> None:
        """The main thread is alive (pulse mode: keeps the watchdog satisfied)."""
        self._last_touch = time.monotonic()

    @contextlib.contextmanager
    def busy(self, op: str, deadline_s: float) -> Iterator[None]:
        """Declare a call the main thread may block in for up to `deadline_s`;
        heartbeats go on (pulse mode) and carry `busy: {op, since_s}`."""
        now = time.monotonic()
        call = Call(op, now, now + max(0.0, deadline_s))
        with self._cond:
            self._calls = (*self._calls, call)
        self._last_touch = now
        try:
            yield
        finally:
            with self._cond:
                self._calls = tuple(c for c in self._calls if c is not call)
            self._last_touch = time.monotonic()

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Pulse mode: the main thread waits for work (and only answers what
        comes) inside this block. One beat says so (`values["idle"] = 1`), then
        the pulse is silent until the block ends: the supervisor holds an idle
        child alive by its process, not by its beats (docs/supervisor.md,
        "Liveness"). Leaving the block sends a beat at once and the beats
        resume. Plain mode: no effect."""
        if not self.pulse:
            yield
            return
        with self._cond:
            self._idle = True
            self._cond.notify()
        try:
            yield
        finally:
            self._last_touch = time.monotonic()
            with self._cond:
                self._idle = False
                self._cond.notify()

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 gives queued messages (a final beat) that long to leave."""
        if self._thread is not None:
            with self._cond:
                self._closing = True
                self._linger_ms = linger_ms
                self._cond.notify()
            self._thread.join(timeout=linger_ms / 1000 + 2.0)
            self._thread = None
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None

    # --- the pulse thread (owns its socket) ---------------------------------------
    def _run(self) -> None:
        sock = self._open()
        try:
            with self._cond:  # started by connect(): nothing is sent before ready()
                while not self._readied and not self._closing:
                    self._cond.wait()
            next_beat = time.monotonic() + self.interval_s
            was_alive = True
            was_idle = False
            while True:
                with self._cond:
                    while not self._outbox and not self._closing:
                        if self._idle:
                            if not was_idle:
                                break  # say it once, then wait without a timeout
                            self._cond.wait()
                            continue
                        if was_idle:
                            break  # the wait is over: beat at once
                        wait_s = next_beat - time.monotonic()
                        if wait_s <= 0:
                            break
                        self._cond.wait(wait_s)
                    outbox, self._outbox = self._outbox, []
                    closing = self._closing
                    values, calls, idle = self._values, self._calls, self._idle
                for message in outbox:
                    _send_nowait(sock, message)
                if closing:
                    return
                now = time.monotonic()
                if idle != was_idle:
                    was_idle = idle
                    next_beat = now + self.interval_s
                    beat_values = {**values, "idle": 1} if idle else values
                    _send_nowait(sock, self._heartbeat(beat_values, now, calls))
                    continue
                if idle or now < next_beat:
                    continue
                next_beat = now + self.interval_s
                alive = shows_life(now, self._last_touch, calls, self.stall_s)
                if alive:
                    _send_nowait(sock, self._heartbeat(values, now, calls))
                else:
                    self.withheld += 1
                    if was_alive:
                        log.error("heartbeat_withheld", actor=self.actor,
                                  silent_s=round(now - self._last_touch, 3),
                                  busy=calls[0].op if calls else None)
                was_alive = alive
        finally:
            sock.close(linger=self._linger_ms)


def _send_nowait(sock: zmq.Socket[bytes], message: protocol.Ready | protocol.Heartbeat) -> None:
    # supervisor busy or gone: liveness is best effort, the work goes on
    with contextlib.suppress(zmq.Again):
        sock.send(protocol.encode(message), zmq.NOBLOCK)
