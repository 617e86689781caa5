"""Fixtures shared by every test: a short state directory (ipc paths are
limited to 107 bytes) and the process tracker that fails a test which leaks.

At the start of a run corral's sources are byte-compiled once: with
PYTHONDONTWRITEBYTECODE set (some shells and CI runners set it), every process
a test starts would otherwise compile every module it imports again (about a
fifth of a writer's or an agent's start)."""

from __future__ import annotations

import compileall
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.statedir import StateDir
from tests.processes import REPO_ROOT, ProcessTracker


def pytest_sessionstart(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller compiled them
    for package in ("broker", "actors", "supervisor", "tests"):
        compileall.compile_dir(REPO_ROOT / package, quiet=2, workers=1)


@pytest.fixture
def state_dir() -> Iterator[StateDir]:
    root = Path(tempfile.mkdtemp(prefix="corral-", dir="/tmp"))
    try:
        yield StateDir(root / ".corral").ensure()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def processes(state_dir: StateDir) -> Iterator[ProcessTracker]:
    tracker = ProcessTracker(state_dir.root.parent)
    yield tracker
    leaked = tracker.cleanup()
    if leaked:
        pytest.fail("processes leaked by the test:\n" + "\n".join(leaked))


@pytest.fixture(scope="session")
def fleet_cluster() -> Iterator[Any]:
    """One local 3-node NATS JetStream cluster for every fleet test of the run
    (tests/fleetkit.py; each test uses its own host names, so its own streams)."""
    from tests.fleetkit import start_cluster, stop_cluster

    cluster = start_cluster(3)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
