"""The sandbox's seccomp filter (actors/procs/seccomp.py, docs/security.md):
a command a hostile model wrote (`write_file`, then `bash`) calls what the
filter denies (ptrace of the sandbox's init, another process's memory, the
kernel keyring, BPF, perf, mounts, namespaces, module loading) and gets
EPERM for each, while ordinary work goes on."""

from __future__ import annotations

import json
import platform
import sys

import pytest

from actors.procs import seccomp
from tests.security.stack import Runtime, output_of

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

PROBE = r'''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return ctypes.get_errno() if r < 0 else 0
NR = json.loads(os.environ.get("NR") or open("nr.json").read())
out = {}
out["ptrace"] = call(NR["ptrace"], 16, 1, 0, 0)  # PTRACE_ATTACH to the sandbox's init
if out["ptrace"] == 0:
    os.waitpid(1, 0x40000000)
    call(NR["ptrace"], 17, 1, 0, 0)  # PTRACE_DETACH
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
out["process_vm_readv"] = call(NR["process_vm_readv"], 1, ctypes.addressof(iov), 1,
                               ctypes.addressof(iov), 1, 0)
out["keyctl"] = call(NR["keyctl"], 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
out["bpf"] = call(NR["bpf"], 0, 0, 0)
out["perf_event_open"] = call(NR["perf_event_open"], 0, 0, -1, -1, 0)
out["unshare"] = call(NR["unshare"], 0x00020000)  # CLONE_NEWNS
out["mount"] = call(NR["mount"], 0, 0, 0, 0, 0)
out["init_module"] = call(NR["init_module"], 0, 0, 0)
out["getpid"] = call(39 if os.uname().machine == "x86_64" else 172)
print(json.dumps(out))
'''


@pytest.mark.skipif(platform.machine() not in seccomp.ARCHES, reason="no syscall table")
def test_a_command_gets_eperm_for_every_denied_call(shared: Runtime) -> None:
    ws = shared.tmp / "ws-seccomp"
    ws.mkdir()
    table = seccomp.ARCHES[platform.machine()][1]
    results = shared.run_agent("seccomp-1", [
        {"op": "write_file", "path": "probe.py", "content": PROBE},
        {"op": "write_file", "path": "nr.json", "content": json.dumps(table)},
        {"op": "bash", "command": f"{sys.executable} probe.py", "timeout_s": 20},
    ], workspace=ws)
    out = output_of(results["3.0"])
    assert results["3.0"]["state"] == "exited", out
    got = json.loads(out.strip().splitlines()[-1])
    eperm = 1
    assert got.pop("getpid") == 0  # an allowed call still works
    assert got == dict.fromkeys(got, eperm), got


def test_the_filter_checks_the_architecture_and_denies_the_list() -> None:
    """The program starts with the arch check and ends allow, deny; every
    denied call of the machine's table is one comparison."""
    program = seccomp.program("x86_64")
    insns = [program[i:i + 8] for i in range(0, len(program), 8)]
    assert insns[0][:2] == b"\x20\x00" and insns[2][4:] == (0x80000000).to_bytes(4, "little")
    assert insns[-2][4:] == seccomp.RET_ALLOW.to_bytes(4, "little")
    assert insns[-1][4:] == (seccomp.RET_ERRNO | seccomp.EPERM).to_bytes(4, "little")
    denied = {int.from_bytes(i[4:], "little") for i in insns[4:-2]}
    assert {seccomp.ARCHES["x86_64"][1][n] for n in ("ptrace", "bpf", "mount")} <= denied
    with pytest.raises(seccomp.UnsupportedArchError):
        seccomp.program("mips")
