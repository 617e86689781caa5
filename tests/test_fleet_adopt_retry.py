"""An adopter reading a dead host's bundles while the cluster is failing
(supervisor/fleet/adopt.py): a listing that times out is not "no objects"
(an adopter once recorded a dead host adopted with none of its agents, which
nobody then adopted: the fleet soak in CI, the dead host's NATS node killed
with it), a transient read is retried, and a missing object is not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError, ObjectNotFoundError

from broker.statedir import StateDir
from supervisor.fleet import adopt


class Bucket:
    """An object store bucket that fails its first calls as told."""

    def __init__(self, *, list_errors: list[Exception] | None = None,
                 get_errors: list[Exception] | None = None) -> None:
        self.list_errors = list(list_errors or [])
        self.get_errors = list(get_errors or [])
        self.gets = 0

    async def list(self) -> list[Any]:
        if self.list_errors:
            raise self.list_errors.pop(0)
        return [SimpleNamespace(name="h1/a1/spec", deleted=False)]

    async def get(self, name: str) -> Any:
        self.gets += 1
        if self.get_errors:
            raise self.get_errors.pop(0)
        return SimpleNamespace(data=b'{"task": "t.yaml"}')


def test_a_listing_that_times_out_is_raised_and_an_empty_bucket_is_empty() -> None:
    with pytest.raises(NatsTimeoutError):
        asyncio.run(adopt._names(Bucket(list_errors=[NatsTimeoutError()])))
    assert asyncio.run(adopt._names(Bucket(list_errors=[NotFoundError()]))) == []
    assert asyncio.run(adopt._names(Bucket())) == ["h1/a1/spec"]


def test_an_adoption_whose_listing_fails_fails_and_records_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """adopt_host raises, so the watcher writes no `adopted_at` and tries the
    dead host again next round (before: [] and the host marked adopted)."""
    bucket = Bucket(list_errors=[NatsTimeoutError()])

    async def objects_bucket(js: Any, replicas: int) -> Bucket:
        return bucket

    monkeypatch.setattr(adopt, "objects_bucket", objects_bucket)
    state = StateDir(tmp_path / ".corral").ensure()
    with pytest.raises(NatsTimeoutError):
        asyncio.run(adopt.adopt_host(None, "h1", state, 3))


def _stub_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    async def pack(bucket: Any, names: list[str], dead: str, agent: str) -> bytes:
        return b"pack"

    async def gens(bucket: Any, names: list[str], dead: str, agent: str) -> list[Any]:
        return []

    monkeypatch.setattr(adopt, "download_pack", pack)
    monkeypatch.setattr(adopt, "download_extras", gens)
    monkeypatch.setattr(adopt.generations, "download", gens)


def test_a_bundle_read_failing_while_the_cluster_elects_is_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_downloads(monkeypatch)
    bucket = Bucket(get_errors=[NoRespondersError(), NatsTimeoutError()])
    spec, pack, _, _ = asyncio.run(adopt._fetch_bundle(bucket, [], "h1", "a1"))
    assert spec == {"task": "t.yaml"} and pack == b"pack" and bucket.gets == 3


def test_a_missing_object_is_not_retried_and_a_failing_cluster_gives_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_downloads(monkeypatch)
    missing = Bucket(get_errors=[ObjectNotFoundError()])
    with pytest.raises(ObjectNotFoundError):
        asyncio.run(adopt._fetch_bundle(missing, [], "h1", "a1"))
    assert missing.gets == 1
    monkeypatch.setattr(adopt, "FETCH_RETRY_S", 0.3)
    down = Bucket(get_errors=[NatsTimeoutError()] * 10)
    with pytest.raises(NatsTimeoutError):
        asyncio.run(adopt._fetch_bundle(down, [], "h1", "a1"))
    assert 1 < down.gets < 10
