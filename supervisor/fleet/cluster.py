"""A local NATS JetStream cluster for development and tests (`fleet up/down`).

Debian's nats-server 2.9 is refused (no `sync_interval`). See docs/fleet.md
("Set-up").
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from broker.durable import write_atomic
from broker.errors import ConfigError

CLUSTER_NAME = "corral"
# nodes started by this process, kept so they are reaped (not collected running)
_STARTED: dict[int, subprocess.Popen[bytes]] = {}
MIN_SERVER = (2, 12)  # atomic batches, sync_interval; older servers are refused


@dataclass(frozen=True)
class Node:
    index: int
    client_port: int
    route_port: int
    pid: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"


def fleet_dir(state_root: Path) -> Path:
    return state_root / "fleet"


def server_binary() -> str:
    """The nats-server of the `fleet` extra (next to this interpreter), else PATH's."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise ConfigError("no nats-server: install the fleet extra (pip install -e '.[fleet]')")
    out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10,
                         check=False).stdout
    try:
        version = tuple(int(p) for p in out.strip().rsplit("v", 1)[1].split(".")[:2])
    except (IndexError, ValueError):
        raise ConfigError(f"{found}: cannot read its version ({out.strip()[:80]!r})") from None
    if version < MIN_SERVER:
        raise ConfigError(f"{found} is {out.strip()}: corral needs nats-server >= 2.12 "
                          "(sync_interval, atomic batches); install the fleet extra")
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_config(index: int, client_port: int, route_port: int, routes: list[int],
                store: Path) -> str:
    """One node's configuration (NATS config syntax, JSON-compatible values)."""
    route_urls = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in routes)
    return (
        f'server_name: "n{index}"\n'
        f"listen: 127.0.0.1:{client_port}\n"
        "max_payload: 8MB\n"
        f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n  sync_interval: always\n}}\n"
        f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{route_port}\n"
        f"  routes: [{route_urls}]\n}}\n"
    )


def _alive(pid: int) -> bool:
    import psutil  # noqa: PLC0415

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def read_cluster(state_root: Path) -> list[Node]:
    path = fleet_dir(state_root) / "cluster.json"
    try:
        data = json.loads(path.read_text())
        return [Node(**n) for n in data["nodes"]]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc


def start_node(state_root: Path, node: Node) -> Node:
    """(Re)start one configured node; its pid is recorded in cluster.json."""
    home = fleet_dir(state_root) / f"node{node.index}"
    log = (home / "server.log").open("ab")
    try:
        proc = subprocess.Popen(
            [server_binary(), "-c", str(home / "server.conf")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)
    finally:
        log.close()
    _STARTED[proc.pid] = proc
    started = Node(node.index, node.client_port, node.route_port, proc.pid)
    nodes = [started if n.index == node.index else n for n in read_cluster(state_root)]
    _write_cluster(state_root, nodes)
    return started


def _write_cluster(state_root: Path, nodes: list[Node]) -> None:
    data = {"nodes": [n.__dict__ for n in nodes], "urls": [n.url for n in nodes]}
    write_atomic(fleet_dir(state_root) / "cluster.json", json.dumps(data, indent=1).encode())


def up(state_root: Path, nodes: int, timeout_s: float = 30.0) -> list[Node]:
    """Start an `nodes`-node cluster (or return the running one)."""
    running = read_cluster(state_root)
    if running and all(_alive(n.pid) for n in running):
        return running
    if running:
        down(state_root)
    if not 1 <= nodes <= 9:
        raise ConfigError(f"--nodes {nodes}: between 1 and 9")
    ports = free_ports(2 * nodes)
    client, route = ports[:nodes], ports[nodes:]
    base = fleet_dir(state_root)
    placed = []
    for i in range(nodes):
        home = base / f"node{i + 1}"
        (home / "js").mkdir(parents=True, exist_ok=True, mode=0o700)
        others = [p for j, p in enumerate(route) if j != i] if nodes > 1 else []
        text = node_config(i + 1, client[i], route[i], others, home / "js")
        if nodes == 1:
            text = text.split("cluster {")[0]
        (home / "server.conf").write_text(text)
        placed.append(Node(i + 1, client[i], route[i], 0))
    _write_cluster(state_root, placed)
    started = [start_node(state_root, n) for n in placed]
    wait_ready([n.url for n in started], timeout_s)
    return read_cluster(state_root)


def wait_ready(urls: list[str], timeout_s: float) -> None:
    """Until JetStream answers account info through every URL (a meta leader)."""
    import asyncio  # noqa: PLC0415 - only with the fleet extra

    import nats  # noqa: PLC0415

    async def probe(url: str) -> bool:
        try:
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False,
                                    error_cb=_quiet)
        except Exception:  # noqa: BLE001 - not up yet
            return False
        try:
            await nc.jetstream(timeout=1).account_info()
        except Exception:  # noqa: BLE001 - no meta leader yet
            return False
        finally:
            await nc.close()
        return True

    async def placement(url: str, replicas: int) -> bool:
        """A stream of `replicas` can be placed now: every peer is current with
        the meta leader (answering account info is not enough: a node just
        started, or lagging under load, makes an R3 bucket's creation fail
        with "no suitable peers for placement", seen in CI). A throwaway
        in-memory stream, named uniquely so that probes never meet, is made
        and deleted."""
        from nats.js.api import StorageType, StreamConfig  # noqa: PLC0415

        try:
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False,
                                    error_cb=_quiet)
        except Exception:  # noqa: BLE001 - not up
            return False
        try:
            js = nc.jetstream(timeout=2)
            name = f"corral_ready_{secrets.token_hex(6)}"
            await js.add_stream(StreamConfig(
                name=name, subjects=[f"corral.ready.{name}"], num_replicas=replicas,
                storage=StorageType.MEMORY, max_msgs=1))
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        except Exception:  # noqa: BLE001 - no suitable peers yet, or no leader
            return False
        finally:
            await nc.close()
        return True

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not asyncio.run(probe(u))]
        if pending and time.monotonic() > deadline:
            raise ConfigError(f"the cluster did not become ready in {timeout_s:g}s: {pending}")
        if pending:
            time.sleep(0.2)
    replicas = min(3, len(urls))
    while not asyncio.run(placement(urls[0], replicas)):
        if time.monotonic() > deadline:
            raise ConfigError(f"the cluster did not become ready in {timeout_s:g}s: no "
                              f"{replicas} peers for a replicated stream")
        time.sleep(0.2)


def stop_node(node: Node, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    if node.pid <= 0 or not _alive(node.pid):
        proc = _STARTED.pop(node.pid, None)
        if proc is not None:
            proc.wait(timeout_s)
        return
    os.kill(node.pid, sig)
    deadline = time.monotonic() + timeout_s
    while _alive(node.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(node.pid):
        os.kill(node.pid, signal.SIGKILL)
    proc = _STARTED.pop(node.pid, None)
    if proc is not None:
        proc.wait(timeout_s)


def down(state_root: Path) -> int:
    """Stop every node of the local cluster; its store stays (delete .corral/fleet)."""
    nodes = read_cluster(state_root)
    for node in nodes:
        stop_node(node)
    return len(nodes)


async def _quiet(exc: Exception) -> None:
    """nats-py prints every connection error by default; a failure reaches the caller."""
