"""Per-job limits (actors/procs/cgroup.py, docs/security.md "Per-job limits"):
a hostile command forks without end, allocates without end, fills the
sandbox's /tmp; each hits its job's limit, and only that job fails: another
agent's steps go on meanwhile and procs keeps serving. procs runs here with
small limits (40 processes, 96 MiB, an 8 MiB /tmp, 8 MiB more in the
workspace per job) to keep the host calm."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.stack import Runtime, module_runtime, output_of

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
PY = sys.executable
PROCESSES, MEMORY_MIB, TMP_MIB, WORKSPACE_MIB = 40, 96, 8, 8
BOMB_TRIES = 200

# forks children that wait, until a fork fails or BOMB_TRIES; says how many,
# marks the shared workspace, and holds the children until the other agent is done
BOMB = r'''
import os, sys, time
count, kids = 0, []
for _ in range(int(sys.argv[1])):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
    count += 1
print("forked", count, flush=True)
open("capped.flag", "w").close()
deadline = time.monotonic() + 30
while not os.path.exists("other.done") and time.monotonic() < deadline:
    time.sleep(0.05)
'''
HOG = r'''
import sys
chunks = []
for i in range(int(sys.argv[1])):
    chunks.append(bytearray(8 * 1024 * 1024))  # zero-filled: every page touched
print("allocated", len(chunks) * 8, "MiB", flush=True)
'''
WAIT = "for i in $(seq 1 600); do [ -e {flag} ] && exit 0; sleep 0.05; done; exit 1"


@pytest.fixture(scope="module")
def limited() -> Iterator[Runtime]:
    yield from module_runtime("--limit-processes", str(PROCESSES),
                              "--limit-memory-bytes", str(MEMORY_MIB << 20),
                              "--tmp-bytes", str(TMP_MIB << 20),
                              "--limit-workspace-bytes", str(WORKSPACE_MIB << 20))


def _workspace(rt: Runtime, name: str) -> Path:
    ws = rt.tmp / f"ws-{name}"
    ws.mkdir()
    return ws


def test_a_fork_bomb_is_capped_while_another_agent_goes_on(limited: Runtime) -> None:
    ws = _workspace(limited, "bomb")
    (ws / "bomb.py").write_text(BOMB)
    bomber = limited.start_agent("bomber-1", [
        {"op": "bash", "command": f"{PY} bomb.py {BOMB_TRIES}", "timeout_s": 60}], workspace=ws)
    other = limited.run_agent("bystander-1", [
        {"op": "bash", "command": WAIT.format(flag="capped.flag"), "timeout_s": 40},
        {"op": "bash", "command": "echo still-here"},
        {"op": "bash", "command": "touch other.done; echo done"},
    ], workspace=ws)
    assert [other[c]["exit_code"] for c in ("1.0", "2.0", "3.0")] == [0, 0, 0], other
    assert "still-here" in output_of(other["2.0"])
    bombed = limited.finish_agent("bomber-1", bomber)["1.0"]
    said = output_of(bombed)
    forked = int(said.split("forked", 1)[1].split()[0])
    assert 0 < forked < PROCESSES, said  # the wrapper, bwrap and python count too


def test_a_memory_hog_is_killed_alone(limited: Runtime) -> None:
    ws = _workspace(limited, "hog")
    (ws / "hog.py").write_text(HOG)
    hog = limited.start_agent("hog-1", [
        {"op": "bash", "command": f"{PY} hog.py {MEMORY_MIB // 8 * 3}", "timeout_s": 60}],
        workspace=ws)
    other = limited.run_agent("bystander-2", [{"op": "bash", "command": "echo fine"}])
    assert "fine" in output_of(other["1.0"])
    result = limited.finish_agent("hog-1", hog)["1.0"]
    assert "allocated" not in output_of(result), result
    assert result["exit_code"] in (137, -9), result  # SIGKILLed by the OOM killer
    after = limited.run_agent("bystander-3", [{"op": "bash", "command": "echo procs-alive"}])
    assert "procs-alive" in output_of(after["1.0"])


def test_the_sandbox_tmp_is_a_sized_tmpfs(limited: Runtime) -> None:
    result = limited.run_agent("filler-1", [{"op": "bash", "command": (
        f"dd if=/dev/zero of=/tmp/fill bs=1M count={TMP_MIB * 4} 2>&1; echo rc=$?; "
        "df -m /tmp | tail -1")}])["1.0"]
    out = output_of(result)
    assert "No space left on device" in out and "rc=1" in out, out


# writes 1 MiB to the workspace every 20 ms, up to 200 MiB, saying how far it got
FILLER = r'''
import os, time
with open("big.bin", "wb") as f:
    for i in range(200):
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        time.sleep(0.02)
print("wrote all", flush=True)
'''


def test_a_job_past_its_workspace_quota_ends_quota_exceeded(limited: Runtime) -> None:
    ws = _workspace(limited, "filler")
    (ws / "fill.py").write_text(FILLER)
    filler = limited.start_agent("filler-2", [
        {"op": "bash", "command": f"{PY} fill.py", "timeout_s": 60}], workspace=ws)
    other = limited.run_agent("bystander-4", [{"op": "bash", "command": "echo unaffected"}])
    assert "unaffected" in output_of(other["1.0"])
    result = limited.finish_agent("filler-2", filler)["1.0"]
    assert result["state"] == "quota_exceeded", result
    assert "wrote all" not in output_of(result)
    assert (ws / "big.bin").stat().st_size < 64 << 20  # stopped near the quota, not at 200 MiB
