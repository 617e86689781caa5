"""The harness itself: up, status, stop through the command alone."""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def test_up_status_stop(corral: Corral) -> None:
    corral.up()
    kids = corral.children()
    assert {"writer", "broker", "procs", "subagents"} <= set(kids)
    corral.run("stop")
    assert corral.run("status", rc=None).returncode in (3, 4)
