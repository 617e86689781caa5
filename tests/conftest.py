"""Fixtures shared by every test: a short state directory (ipc paths are
limited to 107 bytes) and the process tracker that fails a test which leaks."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

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
