"""Starting and ending process trees behind a start gate.

No process exists that the registry does not name. Processes outside the
sandbox carry `CORRAL_PROC_ID=<marker>`, a sandbox's bwrap the hostname
`corral-<marker>`, so a job without a control group is still ended whole.
See docs/procs.md ("Ending a tree").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import signal
import struct
import termios
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from actors.procs import cgroup
from actors.procs.sandbox import HOSTNAME_PREFIX
from broker import lifeline

ENV_PROC_ID = "CORRAL_PROC_ID"
GATE_CLOSED_EXIT = 125  # the start gate closed without "go": procs died first
_EXEC_FAILED = 127
_MAX_FD = 1 << 20
# the runtime (state directory) whose jobs this procs marks and sweeps; "" leaves
# the marker the bare proc id (a proc id is a digest of session and msg_id, the
# same in two runtimes on one host whose agents share a name and a call id)
_SCOPE = {"runtime": ""}


def runtime_scope(state_root: str) -> str:
    """The runtime part of the job markers of the runtime at `state_root`."""
    return hashlib.sha256(os.fsencode(os.path.realpath(state_root))).hexdigest()[:12]


def scope_markers(state_root: str) -> None:
    """Scope every job marker to this runtime: another runtime's job with the
    same proc id is then neither found nor signalled by this one's sweep. Set
    once at procs' start, from the state directory (the same after a restart,
    so a restarted procs still finds its own jobs)."""
    _SCOPE["runtime"] = runtime_scope(state_root)


def marker(proc_id: str) -> str:
    """What marks a job's processes: `CORRAL_PROC_ID=<marker>`, `--hostname corral-<marker>`."""
    runtime = _SCOPE["runtime"]
    return f"{proc_id}.{runtime}" if runtime else proc_id


@dataclass
class Spawned:
    pid: int
    gate_fd: int  # write end: `open_gate()` releases the child
    err_fd: int  # read end: EOF once the exec succeeded


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    *,
    stdio_fd: int | None = None,
    controlling_tty: bool = False,
    die_with_parent: bool = False,
    pass_fds: Sequence[int] = (),
) -> Spawned:
    """Fork `argv` in a new session, held at the start gate until `open_gate()`.

    `stdio_fd` becomes fds 0-2 (a PTY slave); None means /dev/null. Every
    other descriptor is closed, except `pass_fds`."""
    parent = os.getpid()
    gate_r, gate_w = os.pipe()
    err_r, err_w = os.pipe()  # close-on-exec: EOF means exec worked
    args = [os.fsencode(a) for a in argv]
    envb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    keep = sorted({err_w, *pass_fds})
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child side runs only until exec
        try:
            os.close(gate_w)
            os.close(err_r)
            os.setsid()
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; exec keeps
                signal.signal(sig, signal.SIG_DFL)  # SIG_IGN, so restore a shell's defaults
            if die_with_parent and not lifeline.die_with_parent(parent):
                os._exit(GATE_CLOSED_EXIT)
            if not os.read(gate_r, 1):
                os._exit(GATE_CLOSED_EXIT)
            os.close(gate_r)
            fd = stdio_fd if stdio_fd is not None else os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
            if controlling_tty:
                fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            low = 3  # nothing of procs' reaches the program (sockets, logs, PTY masters)
            for fd_kept in keep:
                if fd_kept >= low:
                    os.closerange(low, fd_kept)
                    low = fd_kept + 1
            os.closerange(low, _MAX_FD)
            os.chdir(cwd)
            os.execvpe(args[0], args, envb)  # noqa: S606 - argv from the caller, no shell here
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.write(err_w, str(exc.errno or errno.EIO).encode())
        finally:
            os._exit(_EXEC_FAILED)
    os.close(gate_r)
    os.close(err_w)
    return Spawned(pid=pid, gate_fd=gate_w, err_fd=err_r)


def open_gate(spawned: Spawned) -> int | None:
    """Let the child exec; return None on success or the errno of a failed exec."""
    try:
        os.write(spawned.gate_fd, b"g")
    except BrokenPipeError:
        pass  # the child is gone already: its exit status tells
    finally:
        os.close(spawned.gate_fd)
    try:
        data = os.read(spawned.err_fd, 32)
    finally:
        os.close(spawned.err_fd)
    return int(data) if data else None


def abandon(spawned: Spawned) -> None:
    """Close the gate without "go": the child exits 125 without running."""
    for fd in (spawned.gate_fd, spawned.err_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def open_pty(rows: int, cols: int) -> tuple[int, int]:
    """A PTY pair (master non-blocking) with the window size set."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    os.set_blocking(master, False)
    os.set_inheritable(master, False)
    return master, slave


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (its identity with
    the pid: a reused pid has another start time); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def alive(pid: int, ticks: int) -> bool:
    """`pid` still runs and is the same process that was recorded."""
    return start_ticks(pid) == ticks


def group_alive(pgid: int) -> bool:
    if pgid <= 1:
        return False  # no group recorded (0 would be our own, 1 init's)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_is_ours(pgid: int, proc_id: str, sandboxed: bool | None = None) -> bool:
    """A marked process of the job still lives in the process group `pgid`."""
    for pid in marked_pids(proc_id, sandboxed):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pgid:
                return True
    return False


def _other_pids() -> Iterator[int]:
    """Every live process's pid but this one's (from /proc)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            yield int(entry)


def _read_proc(pid: int, name: str) -> bytes:
    """/proc/<pid>/<name> (environ, cmdline); OSError when the process is gone."""
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def marked_pids(proc_id: str, sandboxed: bool | None = None) -> list[int]:
    """Live processes whose environment carries CORRAL_PROC_ID=<proc_id>, or
    whose command line is a sandbox's named `corral-<proc_id>`. A sandboxed
    job is found by the second alone (its sandbox is what outlives a group
    kill), an unconfined one by the first; None (unknown) looks for both."""
    needle = f"{ENV_PROC_ID}={marker(proc_id)}".encode()
    host_arg = f"\0--hostname\0{HOSTNAME_PREFIX}{marker(proc_id)}\0".encode()
    found = []
    for pid in _other_pids():
        try:
            if ((sandboxed is not True and needle in _read_proc(pid, "environ").split(b"\0"))
                    or (sandboxed is not False
                        and host_arg in b"\0" + _read_proc(pid, "cmdline"))):
                found.append(pid)
        except OSError:
            continue
    return found


def runtime_job_pids(state_root: str) -> list[int]:
    """Live processes marked as jobs of the runtime at `state_root`, whatever
    their proc id: `CORRAL_PROC_ID=<id>.<runtime>` in the environment, or a
    sandbox's `--hostname corral-<id>.<runtime>` (killing a sandbox's bwrap
    ends what runs inside it)."""
    suffix = ("." + runtime_scope(state_root)).encode()
    prefix = f"{ENV_PROC_ID}=".encode()
    host_prefix = f"\0--hostname\0{HOSTNAME_PREFIX}".encode()
    found = []
    for pid in _other_pids():
        try:
            env = _read_proc(pid, "environ").split(b"\0")
            cmdline = b"\0" + _read_proc(pid, "cmdline")
        except OSError:
            continue
        at = cmdline.find(host_prefix)
        if (any(v.startswith(prefix) and v.endswith(suffix) for v in env)
                or (at >= 0 and cmdline[at + 1:].split(b"\0", 3)[1].endswith(suffix))):
            found.append(pid)
    return found


def end_runtime_jobs(state_root: str, passes: int = 5) -> list[int]:
    """SIGKILL every job of the runtime at `state_root`: its control groups
    (actors/procs/cgroup.py), and the processes `runtime_job_pids` finds,
    looking again until none is left (a job may fork meanwhile) or `passes`
    looks were made. For a runtime that may not run them any more: a host
    that comes back fenced, its agents adopted elsewhere (docs/fleet.md).
    Returns the pids signalled."""
    ended: list[int] = []
    layout = cgroup.probe(runtime_scope(state_root))
    if layout is not None:  # every job group of the runtime, whatever its processes did
        for name in cgroup.names(layout):
            group = cgroup.Group(name, layout)
            ended += cgroup.members(group)
            cgroup.kill(group)
    for _ in range(passes):
        pids = runtime_job_pids(state_root)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                ended.append(pid)
    return ended


def sandbox_members(proc_id: str) -> list[int] | None:
    """The processes inside the job's sandbox (descendants of its bwrap, not
    bwrap itself nor the sandbox's pid 1); None when the job has no sandbox."""
    host_arg = f"\0--hostname\0{HOSTNAME_PREFIX}{marker(proc_id)}\0".encode()
    children: dict[int, list[int]] = {}
    roots: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if host_arg in b"\0" + f.read():
                    roots.add(pid)
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(pid)
    if not roots:
        return None
    members: list[int] = []
    todo = [c for r in roots for c in children.get(r, [])]
    while todo:
        pid = todo.pop()
        if pid not in roots:
            members.append(pid)
        todo.extend(children.get(pid, []))
    return members


def end_tree(pgid: int, proc_id: str, sig: int, *, sweep: bool = True,
             group: bool = True, sandboxed: bool | None = None) -> None:
    """Signal the process group (with `group`) and every marked process (`sweep`).

    A sandboxed job is asked to end (any signal but SIGKILL) by signalling the
    programs inside its sandbox only: bwrap does not pass signals on, and its
    death would SIGKILL the sandbox at once, leaving no grace period."""
    if sweep and sig != signal.SIGKILL and sandboxed is not False:
        inside = sandbox_members(proc_id)
        if inside is not None:
            for pid in inside:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            return
    if group and pgid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    if sweep:
        for pid in marked_pids(proc_id, sandboxed):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def tree_gone(pgid: int, proc_id: str, *, group: bool = True,
              sandboxed: bool | None = None) -> bool:
    return not (group and group_alive(pgid)) and not marked_pids(proc_id, sandboxed)


def job_env(base: Mapping[str, str], proc_id: str) -> dict[str, str]:
    """`base` minus supervision, plus the marker: the environment of a job's
    processes outside its sandbox (the command's wrapper), and with the
    sandbox off, added to the program's clean one."""
    env = {k: v for k, v in base.items() if k not in ("CORRAL_CONTROL", "CORRAL_ACTOR")}
    env[ENV_PROC_ID] = marker(proc_id)
    return env
