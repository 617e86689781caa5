"""An agent's tree pack goes to the object store incrementally (docs/fleet.md,
"Adoption"): each round uploads only what was appended since the last one,
the adopter's download joins the chunks into the pack byte for byte, and a
pack a collection replaced (or shrank) starts a new generation uploaded whole,
the older generation's chunks deleted. On the real 3-node cluster."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from actors.kernel.settings import AgentSpec, write_spec
from actors.trees.store import packs_dir
from broker.statedir import StateDir
from supervisor.fleet.adopt import OBJECTS, Uploader, _names, download_pack, parse_chunk
from tests.fleetkit import Cluster, forget_hosts

pytestmark = [pytest.mark.fleet]


def test_the_pack_is_uploaded_incrementally_and_whole_after_a_collection(
        fleet_cluster: Cluster, state_dir: StateDir, tmp_path: Path) -> None:
    import nats

    fleet_cluster.wait_ready()
    host = f"hu{uuid.uuid4().hex[:6]}"
    task = tmp_path / "task.yaml"
    task.write_text("steps: []\n")
    write_spec(state_dir, "a1", AgentSpec(task=str(task)))
    pack = packs_dir(state_dir.root) / "a1.pack"
    pack.parent.mkdir(parents=True, exist_ok=True)
    first = os.urandom(50_000)
    pack.write_bytes(first)
    uploader = Uploader(host, state_dir, 3)

    async def go() -> list[tuple[str, Any]]:
        nc: Any = await nats.connect(fleet_cluster.urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            steps: list[tuple[str, Any]] = []
            assert await uploader.sync(js) == 1
            steps.append(("whole", uploader.uploaded_bytes))
            assert await uploader.sync(js) == 0  # nothing changed: nothing uploaded
            with pack.open("ab") as f:
                f.write(b"tail" * 100)
            assert await uploader.sync(js) == 1
            steps.append(("tail", uploader.uploaded_bytes))
            bucket = await js.object_store(OBJECTS)
            names = await _names(bucket)
            steps.append(("chunks", sorted(parse_chunk(n, host, "a1") for n in names
                                           if parse_chunk(n, host, "a1"))))
            steps.append(("pack", await download_pack(bucket, names, host, "a1")))
            # a collection replaces the pack with a smaller one: a new generation
            replaced = pack.with_suffix(".new")
            replaced.write_bytes(b"small")
            replaced.replace(pack)
            assert await uploader.sync(js) == 1
            names = await _names(bucket)
            steps.append(("after", sorted(parse_chunk(n, host, "a1") for n in names
                                          if parse_chunk(n, host, "a1"))))
            steps.append(("pack2", await download_pack(bucket, names, host, "a1")))
            return steps
        finally:
            await nc.close()

    try:
        steps = dict(asyncio.run(go()))
    finally:
        forget_hosts(fleet_cluster.urls, [host])
    assert steps["whole"] == 50_000
    assert steps["tail"] == 50_000 + 400  # only the appended bytes went up
    [(gen, zero), (gen2, offset)] = steps["chunks"]
    assert gen == gen2 and (zero, offset) == (0, 50_000)  # the whole, then the tail
    assert steps["pack"] == first + b"tail" * 100
    [(new_gen, zero)] = steps["after"]  # the old generation's chunks deleted
    assert new_gen != gen and zero == 0
    assert steps["pack2"] == b"small"


async def put_once_ready(kv: Any, key: str, value: bytes, timeout_s: float = 20) -> None:
    """A put into a bucket just created: on a loaded cluster the new stream may
    not take a publish yet (no responders), so it is retried until accepted."""
    from nats.errors import NoRespondersError
    from nats.js.errors import NoStreamResponseError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await kv.put(key, value)
        except (NoRespondersError, NoStreamResponseError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)
        else:
            return


def test_kv_entries_lists_live_keys_only(fleet_cluster: Cluster) -> None:
    """The fleet view's reader (broker/natsclient.kv_entries): purged keys are left
    out, and a bucket holding only purge markers has no entries (the watcher of
    nats-py's keys() is not used: under load it answered "no keys" for live ones)."""
    import nats
    from nats.js.api import KeyValueConfig

    from supervisor.fleet.natsclient import kv_entries
    from supervisor.fleet.view import keys_of

    fleet_cluster.wait_ready()
    bucket = f"corral_test_{uuid.uuid4().hex[:6]}"

    async def go() -> list[dict[str, bytes]]:
        nc: Any = await nats.connect(fleet_cluster.urls, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            seen = [await kv_entries(js, bucket)]  # no bucket yet
            kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1))
            await put_once_ready(kv, "a", b"1")
            await kv.put("b", b"2")
            await kv.purge("b")
            seen.append(await kv_entries(js, bucket))
            await kv.purge("a")
            seen.append(await kv_entries(js, bucket))
            # the supervisor's keys_of: "no keys" from the watcher, checked against the stream
            seen.append({k: b"" for k in await keys_of(kv)})
            await js.delete_key_value(bucket)
            return seen
        finally:
            await nc.close()

    assert asyncio.run(go()) == [{}, {"a": b"1"}, {}, {}]
