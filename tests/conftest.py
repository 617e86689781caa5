"""Fixtures shared by every test: a short state directory (ipc paths are
limited to 107 bytes) and the process tracker that fails a test which leaks."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.statedir import StateDir
from tests.processes import ProcessTracker


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
