"""Helpers for the fleet tests: a local JetStream cluster started with the real
`supervisor fleet up` (one per test session: the `fleet_cluster` fixture of
tests/conftest.py), and reading a host's stream back."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.fleet import cluster
from supervisor.fleet.adopt import OBJECTS, _names
from supervisor.fleet.generations import parse_gen
from supervisor.fleet.replicate import parse_seq_range, stream_name


@dataclass
class Cluster:
    root: Path  # the state directory holding fleet/

    @property
    def nodes(self) -> list[cluster.Node]:
        return cluster.read_cluster(self.root)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def url_args(self) -> list[str]:
        return [a for u in self.urls for a in ("--fleet-url", u)]

    def stop(self, index: int) -> None:
        cluster.stop_node(self.nodes[index])

    def kill(self, index: int) -> None:
        cluster.stop_node(self.nodes[index], signal.SIGKILL)

    def restart(self, index: int) -> None:
        cluster.start_node(self.root, self.nodes[index])

    def wait_ready(self, timeout_s: float = 30) -> None:
        cluster.wait_ready(self.urls, timeout_s)


def start_cluster(nodes: int = 3) -> Cluster:
    root = Path(tempfile.mkdtemp(prefix="corral-fleet-", dir="/tmp")) / ".corral"
    out = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "fleet", "up", "--nodes", str(nodes),
         "--state-dir", str(root), "--json"],
        capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert len(made["urls"]) == nodes
    # the operator's key pair and the hosts' bus secret, made by `fleet up`
    assert all(Path(made[k]).is_file() for k in ("operator_key", "operator_public_key",
                                                   "bus_secret"))
    return Cluster(root)


def stop_cluster(fleet: Cluster) -> None:
    subprocess.run([sys.executable, "-m", "supervisor.cli", "fleet", "down", "--state-dir",
                    str(fleet.root)], capture_output=True, timeout=60, check=False)
    cluster.down(fleet.root)  # again, in case the CLI could not
    shutil.rmtree(fleet.root.parent, ignore_errors=True)


@dataclass
class StreamMessage:
    stream_seq: int
    first: int
    last: int
    lines: list[bytes]
    headers: dict[str, str]


def read_stream(urls: list[str], host: str) -> list[StreamMessage]:
    """Every message of `host`'s stream, in order (fences have first = last = 0)."""
    import nats

    async def go() -> list[StreamMessage]:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            info = await js.stream_info(stream_name(host))
            found: list[StreamMessage] = []
            if int(info.state.messages) == 0:
                return found
            for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
                msg = await js.get_msg(stream_name(host), seq)
                headers = dict(msg.headers or {})
                first, last = (parse_seq_range(headers["Corral-Seq"])
                               if "Corral-Seq" in headers else (0, 0))
                found.append(StreamMessage(seq, first, last,
                                           (msg.data or b"").splitlines(keepends=True), headers))
            return found
        finally:
            await nc.close()

    return asyncio.run(go())


def stream_leader(urls: list[str], host: str) -> str:
    """The server name ("nK") leading `host`'s stream."""
    import nats

    async def go() -> str:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            info = await nc.jetstream(timeout=5).stream_info(stream_name(host))
            return str(info.cluster.leader)
        finally:
            await nc.close()

    return asyncio.run(go())


def stream_records(urls: list[str], host: str) -> dict[int, bytes]:
    """WAL seq -> the record line, for every record in the stream (asserting that
    records arrive gapless and in order, none twice)."""
    records: dict[int, bytes] = {}
    expected = 1
    for msg in read_stream(urls, host):
        if msg.first == 0:
            continue
        assert msg.first == expected, (msg.first, expected)
        assert len(msg.lines) == msg.last - msg.first + 1
        for offset, line in enumerate(msg.lines):
            records[msg.first + offset] = line
        expected = msg.last + 1
    return records


def forget_hosts(urls: list[str], hosts: list[str]) -> None:
    """Take a test's hosts out of the fleet's members, its status bucket and
    their bundles out of the object store, so a later test's hosts neither see
    them in the fleet view, declare them dead nor adopt their agents (call
    once their supervisors are gone)."""
    import nats
    from nats.js.errors import BucketNotFoundError, NotFoundError

    from supervisor.fleet.adopt import OBJECTS
    from supervisor.fleet.buskeys import BUCKET as BUS_KEYS
    from supervisor.fleet.natsclient import HOSTS_BUCKET
    from supervisor.fleet.watch import MEMBERS

    async def go() -> None:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            try:
                members = await js.key_value(MEMBERS)
                for host in hosts:
                    await members.purge(host)
            except (BucketNotFoundError, NotFoundError):
                pass
            try:  # their status entries: the fleet view (and placement's least-loaded
                # host) would otherwise show them, stale, to a later test's hosts
                status = await js.key_value(HOSTS_BUCKET)
                for host in hosts:
                    await status.purge(host)
            except (BucketNotFoundError, NotFoundError):
                pass
            try:  # their bus keys (supervisor/fleet/buskeys.py)
                keys = await js.key_value(BUS_KEYS)
                for host in hosts:
                    await keys.purge(host)
            except (BucketNotFoundError, NotFoundError):
                pass
            try:
                bucket = await js.object_store(OBJECTS)
                for info in await bucket.list():
                    if info.name.split("/")[0] in hosts:
                        await bucket.delete(info.name)
            except (BucketNotFoundError, NotFoundError):
                pass
        finally:
            await nc.close()

    asyncio.run(go())


@dataclass(frozen=True)
class FleetKeys:
    """The keys of a test's fleet: the operator's pair (the private key for the
    operator's command line only) and the hosts' bus secret."""

    operator: Path  # private: CORRAL_OPERATOR_KEY, never in a host's configuration
    public: Path  # fleet.operator_public_key
    bus_secret: Path  # fleet.bus_secret

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with CORRAL_OPERATOR_KEY naming the operator's private key."""
        return {**base, "CORRAL_OPERATOR_KEY": str(self.operator)}


def make_keys(directory: Path) -> FleetKeys:
    """A fresh operator key pair and bus secret under `directory` (as `fleet up`)."""
    from supervisor.fleet import buskeys, operatorsig

    private, public = operatorsig.make_keys(directory / "operator")
    return FleetKeys(private, public, buskeys.make_bus_secret(directory / "bus.secret"))


def operator_key_and_hosts(state_dir_root: Path) -> tuple[FleetKeys, str, str]:
    """Fresh fleet keys (beside the state directory, outside it) and two host
    names unique to this test (the cluster outlives it)."""
    import uuid

    tag = uuid.uuid4().hex[:6]
    return make_keys(state_dir_root.parent / "fleet-keys"), f"ha{tag}", f"hb{tag}"


async def register_bus_key(js: Any, host: str, public: str, replicas: int = 3,
                           timeout_s: float = 30.0) -> bool:
    """`buskeys.register` for a host the test plays, tried again while the
    cluster does not answer (a stream just made, a leader being elected), as
    the bridge does, until `timeout_s`."""
    import nats.errors

    from supervisor.fleet import buskeys

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await buskeys.register(js, host, public, replicas)
        except nats.errors.Error:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)  # the cluster's own recovery is awaited


async def stored_generations(js: Any, host: str, agent: str, want: list[int]) -> list[int]:
    """The seqs of `host`'s generation objects of `agent`, once the listing
    shows `want` (a clustered object store's listing may trail a delete made
    through another node for a moment) or at a 10 s deadline."""
    bucket = await js.object_store(OBJECTS)
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        got = sorted(s for n in await _names(bucket)
                     if (s := parse_gen(n, host, agent)) is not None)
        if got == want or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.1)
