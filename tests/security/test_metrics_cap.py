"""The metrics endpoint cannot be made to pile up supervisor threads: idle
connections beyond MAX_CONNECTIONS are closed at once, the ones it serves
are dropped after CONNECTION_TIMEOUT_S of silence, and a scrape is answered
again once the flood is gone (supervisor/runtime/metrics.py, docs/security.md)."""

from __future__ import annotations

import socket
import threading
import urllib.request
from pathlib import Path

import pytest

from supervisor.runtime.metrics import MAX_CONNECTIONS, MetricsServer
from tests.processes import wait_for

pytestmark = pytest.mark.timeout(60)
FLOOD = 60


def _scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            return b"corral_child_up" in reply.read() or reply.status == 200
    except OSError:
        return False


def test_idle_connections_are_capped_and_scrapes_go_on(tmp_path: Path) -> None:
    server = MetricsServer("127.0.0.1:0", tmp_path / "metrics.port")
    port = server.start()
    base = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda: getattr(server, "refused", 0) >= FLOOD // 2
                 or threading.active_count() > base + MAX_CONNECTIONS, 10,
                 "the server to take the connections")
        assert threading.active_count() <= base + MAX_CONNECTIONS
        assert server.refused >= FLOOD // 2  # closed at once: no thread held
    finally:
        for sock in idle:
            sock.close()
    try:
        wait_for(lambda: _scrape(port), 10, "a scrape to be answered after the flood")
    finally:
        server.close()
