"""ops/corral.service: `supervisor up` in the foreground, reload by SIGHUP, stop by
`supervisor stop`, restarted on failure but not on the exit codes an operator must
fix; `systemd-analyze verify` accepts it where systemd is installed."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT

UNIT = REPO_ROOT / "ops" / "corral.service"


def _service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def test_unit_runs_up_in_the_foreground_and_maps_stop_and_reload() -> None:
    service = _service()
    start = service["ExecStart"].split()
    assert start[0].endswith("/supervisor") and start[1] == "up" and "--detach" not in start
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    stop = service["ExecStop"].lstrip("-").split()
    assert stop[0] == start[0] and stop[1] == "stop"
    assert service["Type"] == "simple"
    assert service["Restart"] == "on-failure"
    assert set(service["RestartPreventExitStatus"].split()) == {"65", "75", "78"}
    assert service["KillMode"] == "mixed"
    # bubblewrap needs namespaces and mount(2): no hardening may take them away
    assert not {"RestrictNamespaces", "SystemCallFilter", "PrivateUsers"} & set(service)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not installed")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    ours = str(Path(sys.executable).parent / "supervisor")
    unit = tmp_path / "corral.service"
    unit.write_text(UNIT.read_text().replace("/opt/corral/bin/supervisor", ours))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == 0 and "corral.service" not in done.stderr, done.stderr
