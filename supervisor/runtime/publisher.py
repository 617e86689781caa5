"""Status publishing: the status rounds (samples), run/status.json, the
Prometheus endpoint and the status hooks, each at the cost of what changed.

The runtime (supervisor/runtime/loop.py) marks a change and calls a round every
status interval. See docs/supervisor.md ("Status").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from broker import protocol
from supervisor.runtime import statusfile
from supervisor.runtime.hooks import StatusHook, status_hooks
from supervisor.runtime.sampling import SamplerThread, apply_samples

if TYPE_CHECKING:
    from broker.statedir import StateDir
    from supervisor.config import Config
    from supervisor.runtime.children import Child
    from supervisor.runtime.metrics import MetricsServer

# run/status.json is rewritten when a child's state changes, at most every
# status interval; otherwise this often (its counters, samples and ages), so
# that 1,000 idle children do not cost a rewrite a second.
STATUS_REFRESH_S = 30.0
# While nobody asked for a status for this long (and no metrics endpoint nor
# fleet wants samples), a sampling pass reads only SAMPLE_TRICKLE children in
# turn instead of all of them (supervisor/runtime/sampling.py).
WATCHED_S = 10.0
SAMPLE_TRICKLE = 16

log = structlog.get_logger("supervisor")


class StatusPublisher:
    """The children's status, sampled and published to whoever reads it."""

    def __init__(self, state_dir: StateDir, children: Callable[[], dict[str, Child]]) -> None:
        self.state_dir = state_dir
        self.children = children  # the runtime's table, read at each use
        self.started_at = time.time()
        self.sampler = SamplerThread()  # psutil's reads, off the runtime's loop
        self.next_at = 0.0  # monotonic: the next status round
        self.dirty = True  # a child's state changed since the last status file
        self.written_at = -STATUS_REFRESH_S  # monotonic
        self.asked_at = -WATCHED_S  # monotonic: the last status request
        self.error: int | None = None  # errno of the failing status.json write
        self.metrics: MetricsServer | None = None  # started by start_metrics() when configured
        self.hooks: list[StatusHook] = []  # the fleet's host (supervisor/runtime/hooks.py)

    def start_hooks(self, config: Config) -> None:
        """The status hooks that `config` asks for (docs/fleet.md)."""
        self.hooks = status_hooks(config, self.state_dir)

    def close(self) -> None:
        """The last status file, then the sampler, the endpoint and the hooks closed."""
        self.sampler.close()
        self.publish(time.monotonic())
        if self.metrics is not None:
            self.metrics.close()
        for hook in self.hooks:
            hook.close()

    def round_if_due(self, now: float, interval_s: float, agents_starting: bool) -> None:
        if now >= self.next_at:
            self.next_at = now + interval_s
            self.round(now, agents_starting)

    def round(self, now: float, agents_starting: bool) -> None:
        """Samples and the status file, every status interval, each at the cost
        of what changed: a full sampling pass only while someone looks (a
        status request within WATCHED_S, metrics, the fleet), a rewrite of the
        status file only when a child's state changed (or STATUS_REFRESH_S
        passed); otherwise a few children sampled in turn, nothing written.
        `agents_starting`: no USS read (it costs cores the agents need)."""
        children = self.children()
        samples = self.sampler.take()
        if samples:
            apply_samples(children.values(), samples)
        watched = (now - self.asked_at < WATCHED_S or self.metrics is not None
                   or bool(self.hooks))
        self.sampler.submit((c.pid for c in children.values() if c.pid is not None),
                            uss=not agents_starting,
                            limit=None if watched else SAMPLE_TRICKLE)
        if (self.dirty or self.metrics is not None or self.hooks
                or now - self.written_at >= STATUS_REFRESH_S):
            self.publish(now)

    def asked(self, msg_id: str, now: float) -> protocol.StatusReply:
        """A status request: the reply, and full sampling passes for a while."""
        self.asked_at = now
        return self.status(msg_id, now)

    def status(self, msg_id: str, now: float) -> protocol.StatusReply:
        return protocol.StatusReply(
            msg_id=msg_id, supervisor_pid=os.getpid(), state_dir=str(self.state_dir.root),
            started_at=self.started_at,
            children=[c.status(now) for c in self.children().values()],
        )

    def publish(self, now: float) -> None:
        self.dirty = False
        self.written_at = now
        status = self.status("status-file", now).model_dump(mode="json")
        if self.metrics is not None:
            self.metrics.update(status)
        for hook in self.hooks:
            hook.update(status)
        try:
            statusfile.write(self.state_dir.status_path, status)
        except OSError as exc:
            # said once when it starts failing (a full disk fails it every round),
            # and once when it works again
            if self.error != exc.errno:
                log.warning("status_write_failed", error=str(exc))
            self.error = exc.errno
        else:
            if self.error is not None:
                log.info("status_write_recovered")
            self.error = None

    def start_metrics(self, config: Config) -> None:
        """The Prometheus endpoint (`metrics.listen`); a port that cannot be bound is
        logged and the runtime runs without it (metrics never stop the tree)."""
        listen = config.metrics.listen
        if listen is None:
            return
        from supervisor.runtime.metrics import MetricsServer  # noqa: PLC0415 - only when configured

        server = MetricsServer(listen, self.state_dir.run_dir / "metrics.port")
        try:
            port = server.start()
        except OSError as exc:
            log.error("metrics_listen_failed", listen=listen, error=str(exc))
            return
        self.metrics = server
        log.info("metrics_listening", host=server.host, port=port)
