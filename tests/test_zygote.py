"""The zygote's `run` request (a system child started as a fork): only
the modules the zygote preloads can be asked for, with a list of string args."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors import sibling, zygote, zygotewire
from broker.statedir import StateDir
from tests.processes import ProcessTracker

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_request_round_trips_and_names_only_preloaded_modules() -> None:
    data = zygotewire.run_request("writer", "actors.writer", ["--state-dir", "/tmp/a b/.corral"])
    assert zygotewire.parse_request(data) == zygotewire.ForkRequest(
        "writer", None, False, "actors.writer", ("--state-dir", "/tmp/a b/.corral"))
    # with its credential pipe and the model key's names to drop
    data = zygotewire.run_request("broker", "broker.server", [], drop=["OPENAI_API_KEY"],
                              credential=True)
    assert zygotewire.parse_request(data) == zygotewire.ForkRequest(
        "broker", None, True, "broker.server", (), ("OPENAI_API_KEY",))
    with pytest.raises(ValueError, match="does not run"):
        zygotewire.run_request("x", "os", [])
    assert zygotewire.parse_request(b"run x os " + json.dumps([]).encode()) is None
    assert zygotewire.parse_request(b"run x actors.writer not-json") is None
    assert zygotewire.parse_request(b"run x actors.writer [1, 2]") is None
    assert zygotewire.parse_request(b'run x actors.writer {"a": 1}') is None
    assert zygotewire.parse_request(b'run x actors.writer {"argv": [1]}') is None
    assert zygotewire.parse_request(b'run x actors.writer {"argv": [], "drop": [2]}') is None
    assert zygotewire.parse_request(b'run x actors.writer {"argv": ["a\0b"]}') is None
    assert zygotewire.parse_request(b"run") is None
    # the agent forms are unchanged
    assert (zygotewire.parse_request(zygotewire.fork_request("agent-1"))
            == zygotewire.ForkRequest("agent-1"))


def test_a_run_ends_with_the_code_its_interpreter_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A system child forked by the zygote exits as `python -m` would: main's
    return, sys.exit's code (argparse's 2, a message: 1), 1 after a traceback."""
    (tmp_path / "zyfake_main.py").write_text(
        "import argparse, sys\n"
        "def main(argv):\n"
        "    how = argv[0]\n"
        "    if how == 'parse':\n"
        "        argparse.ArgumentParser().parse_args(['--nope'])\n"
        "    if how == 'exit-none':\n"
        "        sys.exit()\n"
        "    if how == 'exit-text':\n"
        "        sys.exit('bad state')\n"
        "    if how == 'raise':\n"
        "        raise ValueError('boom')\n"
        "    return int(how)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    codes = {how: zygote._run_main("zyfake_main", (how,))
             for how in ("0", "65", "parse", "exit-none", "exit-text", "raise")}
    assert codes == {"0": 0, "65": 65, "parse": 2, "exit-none": 0, "exit-text": 1, "raise": 1}
    err = capsys.readouterr().err
    assert "bad state" in err and "ValueError: boom" in err


def test_scrub_removes_a_variable_from_the_environment_and_proc_environ() -> None:
    """A restarted writer drops the model key the zygote holds: gone from
    os.environ, from its children, and from /proc/<pid>/environ."""
    code = (
        "import os, subprocess\n"
        "from actors import envscrub\n"
        "before = open('/proc/self/environ', 'rb').read()\n"
        "envscrub.scrub(['CORRAL_TEST_KEY'])\n"
        "after = open('/proc/self/environ', 'rb').read()\n"
        "child = subprocess.run(['env'], capture_output=True).stdout\n"
        "print(b'sk-scrub-me' in before, b'sk-scrub-me' in after, b'sk-scrub-me' in child,\n"
        "      'CORRAL_TEST_KEY' in os.environ, b'CORRAL_KEEP=1' in after)\n"
    )
    env = {**os.environ, "CORRAL_TEST_KEY": "sk-scrub-me", "CORRAL_KEEP": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=30).stdout
    assert out.split() == ["True", "False", "False", "False", "True"]


# A parent for a real zygote, as the supervisor is one: a child subreaper that
# asks for a burst of forks at once (each agent held at its start gate), then
# for one whose go-between dies (the fault), and reports what it saw as JSON.
# The zygote is told to use go-betweens (--double-fork) where it would clone.
_PARENT = r'''
import json, os, sys, time
import psutil
from actors.zygotelink import ZygoteLink
from broker import lifeline

lifeline.become_subreaper()
link = ZygoteLink(["--state-dir", sys.argv[1], "--double-fork"], dict(os.environ))
zygote_pid = link.start()
assert link.wait_ready(60), "the zygote never said ready"
gates = {}
for i in range(6):
    read_end, write_end = os.pipe()
    assert link.request(f"agent-{i}", gate_fd=read_end)
    os.close(read_end)
    gates[f"agent-{i}"] = write_end
assert link.request("doomed")
replies = {}
deadline = time.monotonic() + 30
while len(replies) < 7 and link._wait_readable(deadline):
    for reply in link.replies():
        replies[reply.name] = reply
pids = {n: r.pid for n, r in replies.items() if hasattr(r, "pid")}
failed = {n: r.reason for n, r in replies.items() if hasattr(r, "reason")}

def settled():
    adopted = all(psutil.Process(p).ppid() == os.getpid() for p in pids.values())
    return adopted and not psutil.Process(zygote_pid).children()

while not settled() and time.monotonic() < deadline:
    time.sleep(0.01)
adopted = sorted(n for n, p in pids.items() if psutil.Process(p).ppid() == os.getpid())
middles_left = len(psutil.Process(zygote_pid).children())
for write_end in gates.values():
    os.close(write_end)  # EOF at the gate: each agent exits 125, unrun
codes = {n: os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for n, p in pids.items()}
link.close()  # EOF: the zygote exits
zygote_code = os.waitstatus_to_exitcode(os.waitpid(zygote_pid, 0)[1])
print(json.dumps({"forked": sorted(pids), "failed": failed, "adopted": adopted,
                  "middles_left": middles_left, "codes": codes, "zygote": zygote_code}))
'''


def test_a_burst_of_forks_is_answered_by_the_go_betweens_and_a_dead_one_by_the_zygote(
    processes: ProcessTracker, state_dir: StateDir,
) -> None:
    """The zygote does not wait for its go-betweens: each forks its agent and
    replies itself, and the zygote reaps them. Six requests sent at once are
    all answered `forked` with distinct pids; every agent is adopted by the
    zygote's parent (a subreaper), which reaps it (exit 125: its start gate
    closed unopened); no go-between is left under the zygote. A go-between
    killed before it replies (the fault) is answered `failed` by the zygote
    (before this change the fault did not exist: `forked`, and the test fails)."""
    proc = processes.spawn(
        ["-c", _PARENT, str(state_dir.root)], name="zygote-parent",
        env={zygote.FAULT_ENV_GO_BETWEEN_DIES: "doomed"})
    assert proc.wait(timeout=50) == 0, processes.output("zygote-parent")
    seen = json.loads(processes.output("zygote-parent").strip().splitlines()[-1])
    names = [f"agent-{i}" for i in range(6)]
    assert seen["forked"] == names
    assert seen["failed"] == {"doomed": "the go-between process failed"}
    assert seen["adopted"] == names
    assert seen["middles_left"] == 0
    assert seen["codes"] == dict.fromkeys(names, zygote.EXIT_GATE_CLOSED)
    assert seen["zygote"] == 0


# A parent (a child subreaper, as the supervisor) of a zygote keeping a pool of
# two: it waits until both members are adopted, kills one, asks for three
# agents (held at their start gates, their output to files), and reports.
_POOL_PARENT = r'''
import json, os, signal, sys, time
import psutil
from actors.zygotelink import ZygoteLink
from broker import lifeline

lifeline.become_subreaper()
root = sys.argv[1]
link = ZygoteLink(["--state-dir", root, "--pool", "2"], dict(os.environ))
zygote_pid = link.start()
assert link.wait_ready(60), "the zygote never said ready"
me = psutil.Process()
deadline = time.monotonic() + 30

def members():
    return sorted(c.pid for c in me.children() if c.pid != zygote_pid)

while len(members()) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
waiting = members()
os.kill(waiting[0], signal.SIGKILL)  # a member dead before any request: not handed one
os.waitpid(waiting[0], 0)
gates, outputs = {}, {}
for i in range(3):
    read_end, write_end = os.pipe()
    outputs[f"agent-{i}"] = os.path.join(root, f"agent-{i}.out")
    assert link.request(f"agent-{i}", outputs[f"agent-{i}"], gate_fd=read_end)
    os.close(read_end)
    gates[f"agent-{i}"] = write_end
replies = {}
while len(replies) < 3 and link._wait_readable(deadline):
    for reply in link.replies():
        replies[reply.name] = reply
pids = {n: r.pid for n, r in replies.items()}

def fd1(pid):
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return None

while any(fd1(p) != outputs[n] for n, p in pids.items()) and time.monotonic() < deadline:
    time.sleep(0.01)
stdout_ok = sorted(n for n, p in pids.items() if fd1(p) == outputs[n])
for write_end in gates.values():
    os.close(write_end)  # EOF at the gate: each agent exits 125, unrun
codes = {n: os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for n, p in pids.items()}
while len(members()) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)  # the pool refilled
refilled = members()
link.close()  # EOF: the zygote exits, and its waiting members with it
rest = {}
for pid in [zygote_pid, *refilled]:
    rest[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"from_pool": sorted(n for n, p in pids.items() if p == waiting[1]),
                  "pids": len(set(pids.values())), "stdout_ok": stdout_ok, "codes": codes,
                  "refilled": len(refilled), "zygote": rest[zygote_pid],
                  "members_exit": sorted(rest[p] for p in refilled)}))
'''


def test_a_pool_member_serves_a_request_and_a_dead_one_is_passed_over(
    processes: ProcessTracker, state_dir: StateDir,
) -> None:
    """With `--pool 2` the zygote keeps two agents forked and adopted ahead of
    any request. One is killed before any request: the requests are served by
    the other (with the request's output as its stdout and its gate held) and
    by fresh forks, never handed to the dead one; every agent exits 125 when
    its gate closes; the pool refills to two, and those members exit 0 when
    the zygote goes."""
    proc = processes.spawn(["-c", _POOL_PARENT, str(state_dir.root)], name="pool-parent")
    assert proc.wait(timeout=50) == 0, processes.output("pool-parent")
    seen = json.loads(processes.output("pool-parent").strip().splitlines()[-1])
    names = [f"agent-{i}" for i in range(3)]
    assert len(seen["from_pool"]) == 1, seen  # the surviving member took one request
    assert seen["pids"] == 3
    assert seen["stdout_ok"] == names
    assert seen["codes"] == dict.fromkeys(names, zygote.EXIT_GATE_CLOSED)
    assert seen["refilled"] == 2
    assert seen["zygote"] == 0
    assert seen["members_exit"] == [0, 0]


# A parent of a zygote that clones (actors/sibling.py): it asks for a burst of
# agents held at their start gates and reads each reply with the sender's pid,
# which the kernel stamps (SO_PASSCRED): a go-between's reply carries its own.
_SIBLING_PARENT = r'''
import json, os, socket, struct, sys, time
import psutil
from actors import zygotewire
from actors.zygotelink import ZygoteLink
from broker import lifeline

lifeline.become_subreaper()
link = ZygoteLink(["--state-dir", sys.argv[1]], dict(os.environ))
zygote_pid = link.start()
assert link.wait_ready(60), "the zygote never said ready"
link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
gates = {}
for i in range(6):
    read_end, write_end = os.pipe()
    assert link.request(f"agent-{i}", gate_fd=read_end)
    os.close(read_end)
    gates[f"agent-{i}"] = write_end
pids, senders, parents = {}, set(), {}
deadline = time.monotonic() + 30
link.sock.setblocking(True)
link.sock.settimeout(30)
while len(pids) < 6 and time.monotonic() < deadline:
    data, ancillary, _flags, _addr = link.sock.recvmsg(4096, socket.CMSG_SPACE(12))
    reply = zygotewire.parse_reply(data)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            senders.add(struct.unpack("iII", payload[:12])[0])
    pids[reply.name] = reply.pid
    parents[reply.name] = psutil.Process(reply.pid).ppid()  # at once, before any exit
zygote_children = len(psutil.Process(zygote_pid).children())
for write_end in gates.values():
    os.close(write_end)  # EOF at the gate: each agent exits 125, unrun
codes = {n: os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for n, p in pids.items()}
link.close()  # EOF: the zygote exits
zygote_code = os.waitstatus_to_exitcode(os.waitpid(zygote_pid, 0)[1])
print(json.dumps({"forked": sorted(pids), "pids": len(set(pids.values())),
                  "senders": sorted(senders), "zygote_pid": zygote_pid,
                  "parents": sorted(set(parents.values())), "me": os.getpid(),
                  "zygote_children": zygote_children, "codes": codes, "zygote": zygote_code}))
'''


@pytest.mark.skipif(not sibling.available(), reason="clone(CLONE_PARENT) is x86_64 glibc only")
def test_a_burst_is_served_by_one_fork_each_the_agents_our_children_from_the_start(
    processes: ProcessTracker, state_dir: StateDir,
) -> None:
    """Where actors/sibling.py works, the zygote forks each agent as its
    parent's child itself: every `forked` reply comes from the zygote (no
    go-between: before this change each came from one, and this fails), each
    agent's parent is the zygote's parent when its reply is read, the zygote
    has no child, and each agent exits 125 when its start gate closes."""
    proc = processes.spawn(["-c", _SIBLING_PARENT, str(state_dir.root)], name="sibling-parent")
    assert proc.wait(timeout=50) == 0, processes.output("sibling-parent")
    seen = json.loads(processes.output("sibling-parent").strip().splitlines()[-1])
    names = [f"agent-{i}" for i in range(6)]
    assert seen["forked"] == names
    assert seen["pids"] == 6
    assert seen["senders"] == [seen["zygote_pid"]]
    assert seen["parents"] == [seen["me"]]
    assert seen["zygote_children"] == 0
    assert seen["codes"] == dict.fromkeys(names, zygote.EXIT_GATE_CLOSED)
    assert seen["zygote"] == 0


_CLONE_CHILD = r'''
import ctypes, json, os, random, sys, threading
from actors import sibling

assert sibling.available()
before = random.random()
pid = sibling.fork_sibling()
if pid == 0:
    libc = sibling._load()
    tid = ctypes.c_int.from_address(sibling._tid_address(libc)).value
    seen = {}
    worker = threading.Thread(target=lambda: seen.update(native=threading.get_native_id()))
    worker.start()
    worker.join()
    os.write(1, (json.dumps({"who": "child", "pid": os.getpid(), "ppid": os.getppid(),
                             "tid": tid,
                             "thread_ran": seen.get("native") not in (None, os.getpid()),
                             "random": random.random()}) + "\n").encode())  # one write
    os._exit(0)
hold = threading.Event()
held = threading.Thread(target=hold.wait)
held.start()  # a second thread: no clone while it runs
try:
    sibling.fork_sibling()
    refused = False
except OSError:
    refused = True
hold.set()
held.join()
os.write(1, (json.dumps({"who": "parent", "pid": os.getpid(), "ppid": os.getppid(),
                         "child": pid, "refused_with_threads": refused,
                         "random": random.random()}) + "\n").encode())
'''


# The parent of the process that clones (so the test's own process reaps
# nothing): it runs _CLONE_CHILD, reaps the clone's child, which is its own,
# and reports both sides' lines and that exit.
_CLONE_GRANDPARENT = r'''
import json, os, subprocess, sys
proc = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
out, _ = proc.communicate(timeout=30)
lines = {d["who"]: d for d in map(json.loads, out.strip().splitlines())}
_pid, status = os.waitpid(lines["child"]["pid"], 0)
print(json.dumps({"me": os.getpid(), "code": proc.returncode,
                  "child_exit": os.waitstatus_to_exitcode(status), **lines}))
'''


@pytest.mark.skipif(not sibling.available(), reason="clone(CLONE_PARENT) is x86_64 glibc only")
def test_fork_sibling_makes_our_parents_child_with_its_own_thread_id() -> None:
    """The clone's child is its caller's parent's child (reaped there), its
    thread control block holds its own thread id (CLONE_CHILD_SETTID, as
    glibc's fork), it can start threads, and the after-fork hooks ran (its
    `random` was reseeded: it draws another number than its caller). A
    process with a second thread is refused."""
    code = f"import sys; sys.path.insert(0, {str(_REPO)!r})\n" + _CLONE_CHILD
    done = subprocess.run([sys.executable, "-c", _CLONE_GRANDPARENT, code], capture_output=True,
                          text=True, timeout=50, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    child, parent = seen["child"], seen["parent"]
    assert seen["code"] == 0 and seen["child_exit"] == 0
    assert parent["child"] == child["pid"]
    assert child["ppid"] == seen["me"] == parent["ppid"]
    assert child["tid"] == child["pid"]
    assert child["thread_ran"] is True
    assert child["random"] != parent["random"]
    assert parent["refused_with_threads"] is True
