"""The child side of supervision: a supervised process tells the supervisor it
is ready and then sends heartbeats (with its counters) on the supervisor's
control socket. Unsupervised (no CORRAL_CONTROL in the environment) it does
nothing, so every actor also runs standalone in tests and benchmarks.

Environment a supervised child receives:
    CORRAL_CONTROL   the supervisor's control endpoint (ipc://.../run/supervisor.sock)
    CORRAL_ACTOR     the child's name (its DEALER identity)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import zmq

from broker import protocol

ENV_CONTROL = "CORRAL_CONTROL"
ENV_ACTOR = "CORRAL_ACTOR"
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0


class ControlReporter:
    """Sends `ready` once and `heartbeat` at most every `interval_s`, never blocking."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        actor: str,
        interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.actor = actor
        self.interval_s = interval_s
        self._pid = os.getpid()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, actor.encode())
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.connect(endpoint)
        self._next_beat = 0.0

    @classmethod
    def from_env(
        cls, ctx: zmq.Context[zmq.Socket[bytes]], default_actor: str
    ) -> ControlReporter | None:
        endpoint = os.environ.get(ENV_CONTROL)
        if not endpoint:
            return None
        return cls(ctx, endpoint, os.environ.get(ENV_ACTOR, default_actor))

    def _send(self, message: protocol.Ready | protocol.Heartbeat) -> None:
        # supervisor busy or gone: liveness is best effort, the work goes on
        with contextlib.suppress(zmq.Again):
            self._sock.send(protocol.encode(message), zmq.NOBLOCK)

    def ready(self) -> None:
        self._send(protocol.Ready(actor=self.actor, pid=self._pid))
        self._next_beat = time.monotonic() + self.interval_s

    def tick(self, values: Callable[[], dict[str, int | float]] | None = None) -> None:
        """Send a heartbeat if one is due. Cheap to call on every loop turn:
        the counters are gathered (`values()`) only when a beat goes out."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.interval_s
        counters = values() if values is not None else {}
        self._send(protocol.Heartbeat(actor=self.actor, pid=self._pid, values=counters))

    def beat(self, values: dict[str, int | float] | None = None) -> None:
        """Send a heartbeat now (e.g. a final report just before a clean exit)."""
        self._next_beat = time.monotonic() + self.interval_s
        self._send(protocol.Heartbeat(actor=self.actor, pid=self._pid, values=values or {}))

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 gives queued messages (a final beat) that long to leave."""
        self._sock.close(linger=linger_ms)
