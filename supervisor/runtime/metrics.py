"""The supervisor's Prometheus endpoint, served from the published status.

At most MAX_CONNECTIONS connections at once; one idle CONNECTION_TIMEOUT_S
is dropped. See docs/supervisor.md ("Metrics") and docs/operations.md
("Metrics").
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

STATES = ("starting", "running", "backoff", "exited", "fatal", "stopping", "stopped")
LABELS = ["name", "kind"]

# heartbeat value -> (metric, help, counter?) per child kind
_NAMED: dict[str, dict[str, tuple[str, str, bool]]] = {
    "writer": {
        "appends_total": ("corral_writer_appends", "records appended", True),
        "duplicates_total": ("corral_writer_duplicates", "appends answered as duplicates",
                             True),
        "rejected_total": ("corral_writer_rejected", "appends refused", True),
        "reads_total": ("corral_writer_reads", "read_stream pages served", True),
        "batches_total": ("corral_writer_batches", "group-commit batches made durable", True),
        "fsyncs_total": ("corral_writer_fsyncs", "fdatasync calls", True),
        "head_seq": ("corral_writer_head_seq", "last durable seq", False),
        "appends_per_s": ("corral_writer_appends_per_second", "append rate", False),
        "dropped_total": ("corral_writer_replies_dropped", "replies not delivered", True),
        "lane_connections": ("corral_writer_lane_connections",
                             "connections on the local lane (run/writer.lane)", False),
        "lane_refused_total": ("corral_writer_lane_refused",
                               "lane hellos, packets and connections refused", True),
        "lane_acks_dropped_total": ("corral_writer_lane_acks_dropped",
                                    "lane acks not delivered (the client gone)", True),
    },
    "broker": {
        "routed_total": ("corral_broker_routed", "messages routed", True),
        "errors_total": ("corral_broker_refused", "messages refused (error replies)", True),
        "rejected_total": ("corral_broker_rejected", "malformed frames", True),
        "unknown_recipient_total": ("corral_broker_unknown_recipient",
                                    "messages to an unknown peer", True),
        "peers": ("corral_broker_peers", "connected peers", False),
    },
    "procs": {
        "live_commands": ("corral_procs_live_commands", "background commands running", False),
        "live_terminals": ("corral_procs_live_terminals", "terminals open", False),
    },
    "subagents": {
        "running_children": ("corral_subagents_running", "subagents running", False),
        "applied_total": ("corral_subagents_applied", "change sets applied", True),
        "refused_total": ("corral_subagents_refused", "change sets refused", True),
    },
    "agent": {
        "turn": ("corral_agent_turns", "model turns of the session", True),
        "tool_calls": ("corral_agent_calls", "tool calls", True),
        "rejects": ("corral_agent_rejects", "actions rejected (schema)", True),
        "aborts": ("corral_agent_aborts", "calls aborted by recovery", True),
        "waiting": ("corral_agent_approvals_waiting", "approval requests pending", False),
        "tokens_used": ("corral_agent_budget_tokens_used", "tokens used", False),
        "cost_used": ("corral_agent_budget_cost_used", "cost units used", False),
        "phase": ("corral_agent_phase",
                  "0 new, 1 running, 2 paused (budget), 3 finished, 4 closed", False),
    },
}
_HISTOGRAMS = {
    "fsync_ms_le_": ("corral_writer_fsync_seconds", "fdatasync latency per batch", 0.001,
                     "fsync_ms_sum"),
    "batch_le_": ("corral_writer_batch_records", "records per group-commit batch", 1.0,
                  "batch_records_sum"),
}


class ConfigError(ValueError):
    """`metrics.listen` is not a loopback host:port."""


def parse_listen(text: str) -> tuple[str, int]:
    """`127.0.0.1:9464`, `localhost:0`, `[::1]:9464` -> (host, port); loopback only."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"metrics.listen {text!r}: expected host:port")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"metrics.listen {text!r}: only a loopback address "
                              f"(127.0.0.1, ::1, localhost) is served")
    return host, int(port_text)


def _bound(key: str, prefix: str) -> float:
    text = key.removeprefix(prefix)
    return math.inf if text == "inf" else float(text)


class StatusCollector(Collector):
    """Metrics from the latest status snapshot (the `status_reply` as data)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"children": []}

    def collect(self) -> Iterator[Any]:
        status = self.snapshot  # one read: the loop may swap it meanwhile
        children: list[dict[str, Any]] = status.get("children", [])
        up = GaugeMetricFamily("corral_child_up", "1 when the child is running", labels=LABELS)
        state = GaugeMetricFamily("corral_child_state", "1 for the child's current state",
                                  labels=[*LABELS, "state"])
        restarts = CounterMetricFamily("corral_child_restarts", "restarts by the supervisor",
                                       labels=LABELS)
        age = GaugeMetricFamily("corral_child_heartbeat_age_seconds",
                                "seconds since the child's last heartbeat", labels=LABELS)
        rss = GaugeMetricFamily("corral_child_rss_bytes", "resident set size", labels=LABELS)
        uss = GaugeMetricFamily("corral_child_uss_bytes", "unique set size", labels=LABELS)
        cpu = GaugeMetricFamily("corral_child_cpu_percent", "CPU use", labels=LABELS)
        other = GaugeMetricFamily("corral_child_value", "other heartbeat values",
                                  labels=[*LABELS, "key"])
        named: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        hists: list[HistogramMetricFamily] = []
        for child in children:
            labels = [str(child.get("name")), str(child.get("kind"))]
            up.add_metric(labels, 1.0 if child.get("state") == "running" else 0.0)
            state.add_metric([*labels, str(child.get("state"))], 1.0)
            restarts.add_metric(labels, float(child.get("restarts") or 0))
            for family, key in ((age, "heartbeat_age_s"), (rss, "rss_bytes"),
                                (uss, "uss_bytes"), (cpu, "cpu_percent")):
                if child.get(key) is not None:
                    family.add_metric(labels, float(child[key]))
            values: dict[str, float] = child.get("values") or {}
            kind_names = _NAMED.get(str(child.get("kind")), {})
            for prefix, (metric, text, scale, sum_key) in _HISTOGRAMS.items():
                buckets = sorted((_bound(k, prefix), float(v)) for k, v in values.items()
                                 if k.startswith(prefix))
                if buckets:
                    cumulative, total = [], 0.0
                    for bound, count in buckets:
                        total += count
                        le = "+Inf" if bound == math.inf else repr(bound * scale)
                        cumulative.append((le, total))
                    hist = HistogramMetricFamily(metric, text, labels=LABELS)
                    hist.add_metric(labels, cumulative,
                                    sum_value=float(values.get(sum_key, 0.0)) * scale)
                    hists.append(hist)
            for key, value in values.items():
                if key in kind_names:
                    metric, text, counter = kind_names[key]
                    if metric not in named:
                        cls = CounterMetricFamily if counter else GaugeMetricFamily
                        named[metric] = cls(metric, text, labels=LABELS)
                    named[metric].add_metric(labels, float(value))
                elif not any(key.startswith(p) for p in _HISTOGRAMS) \
                        and key not in ("fsync_ms_sum", "batch_records_sum"):
                    other.add_metric([*labels, key], float(value))
        yield from (up, state, restarts, age, rss, uss, cpu)
        yield from named.values()
        yield from _merge(hists)
        yield other
        written = status.get("written_at")
        if written is not None:
            yield GaugeMetricFamily("corral_status_age_seconds",
                                    "seconds since this snapshot was taken",
                                    value=max(0.0, time.time() - float(written)))


def _merge(hists: list[HistogramMetricFamily]) -> Iterator[HistogramMetricFamily]:
    """One family per metric name (each child added its own)."""
    by_name: dict[str, HistogramMetricFamily] = {}
    for hist in hists:
        if hist.name in by_name:
            by_name[hist.name].samples.extend(hist.samples)
        else:
            by_name[hist.name] = hist
    yield from by_name.values()


MAX_CONNECTIONS = 8  # served at once; scrapers are few (a Prometheus, an operator's curl)
CONNECTION_TIMEOUT_S = 5.0  # a connection silent this long is dropped


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged to stderr."""


class _CappedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most MAX_CONNECTIONS at once."""

    daemon_threads = True
    request_queue_size = 64  # the listen backlog: a burst waits to be refused, not SYN-dropped

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # closed at once: no thread, no wait
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _serve(host: str, port: int, registry: CollectorRegistry) -> tuple[_CappedServer,
                                                                       threading.Thread]:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    server_class = type("_Server", (_CappedServer,), {"address_family": family})
    httpd: WSGIServer = make_server(host, port, make_wsgi_app(registry),
                                    server_class=server_class, handler_class=_Handler)
    assert isinstance(httpd, _CappedServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics")
    thread.start()
    return httpd, thread


class MetricsServer:
    """The endpoint: start() binds (raises OSError when it cannot), update() swaps
    the snapshot, close() stops serving and removes run/metrics.port."""

    def __init__(self, listen: str, port_file: Path) -> None:
        self.host, self.port = parse_listen(listen)
        self.port_file = port_file
        self.collector = StatusCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server: _CappedServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def refused(self) -> int:
        """Connections closed at once because MAX_CONNECTIONS were being served."""
        return self._server.refused if self._server is not None else 0

    def start(self) -> int:
        self._server, self._thread = _serve(self.host, self.port, self.registry)
        self.port = int(self._server.server_address[1])
        tmp = self.port_file.with_name(f".{self.port_file.name}.tmp")
        tmp.write_text(f"{self.port}\n", encoding="ascii")
        os.replace(tmp, self.port_file)
        return self.port

    def update(self, status: dict[str, Any]) -> None:
        self.collector.snapshot = {**status, "written_at": time.time()}

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.port_file.unlink(missing_ok=True)
