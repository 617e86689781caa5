"""A full disk stops work, never an agent (docs/storage.md, "A full disk"):
agents whose state directory is a tmpfs shrunk to what they use fill it with their own work;
the runtime stops appending, no agent ends `fatal`; once the operator frees
space (the volume grown), every agent resumes on its own, with the default
configuration, and finishes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process]

AGENTS = 8
WAITED_S = 45.0  # past the 22 s append deadline and the 10 s heartbeat timeout
BLOCK = "0123456789abcdef" * 640  # 10 KiB of text a pass writes
TASK = f"""\
name: filler
prompt: Write large files, one per pass.
repeat: 200
setup:
  - {{op: ask, question: "start?"}}
steps:
  - {{op: write_file, path: "big{{i}}.txt", content: "{{i}} {BLOCK}"}}
  - {{op: write_file, path: "notes/{{i}}.txt", content: "pass {{i}}\\n"}}
"""


@pytest.fixture
def small_disk(corral: Corral) -> Iterator[Corral]:
    """The user's state directory on a 32 MiB tmpfs (unmounted at teardown)."""
    if subprocess.run(["id", "-u"], capture_output=True, text=True,
                      check=False).stdout.strip() != "0":
        pytest.skip("mounting a tmpfs needs root")
    corral.state_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(corral.state_dir)],
                   check=True)
    try:
        yield corral
    finally:
        with contextlib.suppress(Exception):
            corral.stop()
        subprocess.run(["umount", "-l", str(corral.state_dir)], check=False)


def waiting(corral: Corral, agent: str) -> bool:
    """The agent's heartbeat says a request waits."""
    result = corral.run("status", agent, "--json", rc=None)
    return result.returncode == 0 and result.json()["children"][0]["values"].get("waiting", 0) > 0


def shrink_to_what_is_used(corral: Corral, headroom_mib: int) -> None:
    """Remount the tmpfs at its current use plus `headroom_mib` (retried while
    the agents' writes make the first figure too small)."""
    def shrunk() -> bool:
        used = os.statvfs(corral.state_dir)
        used_mib = (used.f_blocks - used.f_bfree) * used.f_frsize // (1 << 20)
        return subprocess.run(["mount", "-o", f"remount,size={used_mib + headroom_mib}m",
                               str(corral.state_dir)], check=False,
                              capture_output=True).returncode == 0
    corral.wait(shrunk, "the tmpfs shrunk", timeout_s=30)


@pytest.mark.timeout(600)
def test_agents_on_a_full_disk_wait_and_finish_once_space_is_freed(small_disk: Corral) -> None:
    corral = small_disk
    corral.up()
    task = corral.write("filler.yaml", TASK)
    names = [f"f{n}" for n in range(AGENTS)]
    for name in names:  # each asks before its work: all start it together
        corral.run("spawn", name, "--task", str(task))
    corral.wait(lambda: all(waiting(corral, n) for n in names), "every agent to ask")
    for name in names:
        corral.run("answer", name, "req-1.0", "go")
    shrink_to_what_is_used(corral, headroom_mib=16)  # their own work fills the rest

    def full() -> bool:
        free = os.statvfs(corral.state_dir)
        writer = corral.children()["writer"]
        return free.f_bavail * free.f_frsize < (1 << 20) or bool(
            writer.get("values", {}).get("storage_full"))

    corral.wait(full, "the disk to fill", timeout_s=240)

    def waited_or_died() -> dict[str, Any] | None:
        """Every agent still at work has waited for the writer past its own
        heartbeat timeout, or one of them was restarted (died)."""
        kids = {n: c for n, c in corral.children().items() if n in names}
        if any(c.get("restarts") or c["state"] == "fatal" for c in kids.values()):
            return kids
        busy = [c.get("busy") or {} for c in kids.values() if c["state"] != "exited"]
        if all(float(b.get("since_s") or 0) >= WAITED_S for b in busy):
            return kids  # (or none is left at work)
        return None

    kids = corral.wait(waited_or_died, "the agents to wait out the full disk", timeout_s=240)
    died = [n for n, c in kids.items() if c.get("restarts") or c["state"] == "fatal"]
    assert not died, (died, [corral.run("logs", "--actor", n, rc=None).stdout[-3000:]
                             for n in died], corral.run("status", rc=None).stdout)
    subprocess.run(["mount", "-o", "remount,size=1g", str(corral.state_dir)], check=True)

    def all_done() -> bool:
        kids = corral.children()
        assert not [n for n in names if kids[n]["state"] == "fatal"], kids
        return all(kids[n]["state"] == "exited" for n in names)

    corral.wait(all_done, "every agent to finish", timeout_s=400)
    rows = corral.json("sessions", "list")
    assert sorted((r["agent"], r["status"]) for r in rows) == [(n, "finished") for n in names]
    # an effect the full disk refused is a typed failure the model sees
    for name in names:
        trace = corral.run("trace", name, "--json").stdout.splitlines()
        failed = [json.loads(line)["payload"] for line in trace
                  if '"tool_result"' in line and '"error"' in line]
        assert all(p["result"].get("error") == "storage_full" for p in failed), failed
    # the supervisor says once that status.json cannot be written, not every round
    logs = corral.run("logs", "--actor", "supervisor", "--json").stdout.splitlines()
    said = [line for line in logs if '"status_write_failed"' in line]
    assert len(said) <= 2, said
