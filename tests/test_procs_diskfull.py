"""A full disk under procs' job logs (issue 16; actors/procs/terminal.py,
docs/procs.md "A full disk"): a session's `.terminals/` is a small tmpfs the
test mounts and fills. A terminal's output then finds no room in its log:
procs stays up (it crashed on the first ENOSPC before), answers, says so in
its stats and log, holds the output (the program blocks once 1 MiB is held)
and, when the filler is deleted, writes every byte in order: the read by
cursor returns exactly the program's output to its end."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker import protocol
from tests.processes import wait_for
from tests.test_procs import SESSION, Stack, read_all, stack  # noqa: F401 - the fixture

pytestmark = pytest.mark.process
LINES = 150_000  # ~1 MB through the PTY: more than procs holds in memory


@pytest.fixture
def full_terminals(stack: Stack) -> Iterator[Path]:  # noqa: F811 - the fixture imported above
    """The session's `.terminals/` on a 4 MiB tmpfs, filled to the last byte."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = stack.state.agent_dir(SESSION) / ".terminals"
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs",
                           str(mount)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode()[:200]}")
    filler = mount / "filler"
    try:
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        yield filler
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def stats(s: Stack) -> dict[str, object]:
    reply = s.peer.request("procs", protocol.StatsRequest(msg_id=f"s{time.monotonic_ns()}"),
                               timeout_s=2.0)
    assert isinstance(reply, protocol.Stats), reply
    return dict(reply.values)


def test_a_full_disk_under_a_terminal_log_holds_its_output_and_resumes(
    stack: Stack,  # noqa: F811 - the fixture imported above
    full_terminals: Path,
) -> None:
    status = stack.client.terminal_start(["seq", "1", str(LINES)], str(stack.workdir))
    proc_id = status.proc_id
    assert proc_id is not None
    wait_for(lambda: stats(stack).get("log_disk_full") == 1, 20,
             "procs to report the terminal's log full")
    assert stack.procs.poll() is None, stack.processes.output("procs")  # up, not crashed
    out = stack.client.terminal_read(proc_id, 0)
    assert out.state == "running" and not out.eof  # held, not ended without its output
    log = stack.state.log_path("procs").read_text()
    assert "job_log_disk_full" in log and proc_id in log

    full_terminals.unlink()  # space returns
    data, last = read_all(stack.client, proc_id, terminal=True, timeout_s=40)
    expected = b"".join(f"{i}\r\n".encode() for i in range(1, LINES + 1))
    assert len(data) == len(expected) and data == expected
    assert last.state == "exited" and last.exit_code == 0
    assert stats(stack).get("log_disk_full") == 0
    assert "job_log_resumed" in stack.state.log_path("procs").read_text()
    assert stack.procs.poll() is None
