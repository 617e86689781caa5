"""A job's control group: the unit the kernel knows, which procs ends whole.

`cgroup.kill` where there is a v2 tree, else freeze (v1 `freezer`), SIGKILL
every member, thaw; orphan groups of a previous run are killed at start.
See docs/procs.md ("Ending a tree") and docs/decisions.md ("A job is a
control group; the sandbox filters syscalls").
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass, field

MOUNTINFO = "/proc/self/mountinfo"
SELF_CGROUP = "/proc/self/cgroup"
V1_CONTROLLERS = ("pids", "memory", "cpu", "freezer")
V2_LIMITS = ("pids", "memory", "cpu")
FREEZE_WAIT_S = 1.0
V1_CPU_SHARES_PER_WEIGHT = 1024 / 100  # v2 cpu.weight 100 = v1 cpu.shares 1024


class CgroupError(Exception):
    """A job's group cannot be made, joined or limited."""


@dataclass(frozen=True)
class Limits:
    """What one job may use (`sandbox.limits` in config/default.yaml); 0 is no limit."""

    processes: int = 256
    memory_bytes: int = 1 << 30
    cpu_weight: int = 100  # 1..10000, as v2's cpu.weight (100: an equal share)
    workspace_bytes: int = 1 << 30  # bytes a job may add to its workspace (actors/procs/quota.py)


@dataclass(frozen=True)
class Layout:
    """Where this runtime's job groups live, one base directory per hierarchy
    used, and which hierarchy does what."""

    kill: str | None  # a v2 base (its groups have cgroup.kill)
    freezer: str | None  # a v1 freezer base (the kill without cgroup.kill)
    limits: dict[str, str] = field(default_factory=dict)  # pids/memory/cpu -> base
    v2: frozenset[str] = frozenset()  # bases of the v2 tree

    @property
    def bases(self) -> tuple[str, ...]:
        found = [b for b in (self.kill, self.freezer, *self.limits.values()) if b]
        return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class Group:
    """One job's group: its directory in each hierarchy of the layout."""

    name: str
    layout: Layout

    def dirs(self) -> tuple[str, ...]:
        return tuple(os.path.join(base, self.name) for base in self.layout.bases)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, root, v1 controllers) of every cgroup mount."""
    found = []
    for line in _read(MOUNTINFO).splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((tail[0], fields[4].replace("\\040", " "), fields[3],
                      set(tail[2].split(","))))
    return found


def _own_paths() -> tuple[str | None, dict[str, str]]:
    """procs' own group: (its v2 path, {v1 controller: path})."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in _read(SELF_CGROUP).splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and not controllers:
            v2 = path
        for name in controllers.split(","):
            if name:
                v1[name] = path
    return v2, v1


def _join_path(mount: str, root: str, path: str) -> str | None:
    """The directory of group `path` in a hierarchy mounted at `mount` (of
    `root`); None when the group lies outside what the mount shows."""
    if root not in ("/", path) and not path.startswith(root.rstrip("/") + "/"):
        return None
    rel = path[len(root):] if root != "/" else path
    return os.path.join(mount, rel.lstrip("/"))


def _make_base(parent: str, scope: str) -> str | None:
    """The runtime's directory under `parent`, made; None unless it is a
    cgroup (the kernel gives every cgroup a `cgroup.procs`: a directory made
    where the hierarchy is covered by another mount is not one)."""
    base = os.path.join(parent, f"corral-{scope}")
    try:
        os.makedirs(base, mode=0o755, exist_ok=True)
    except OSError:
        return None
    if not os.path.exists(os.path.join(base, "cgroup.procs")):
        with contextlib.suppress(OSError):
            os.rmdir(base)
        return None
    return base


def _v2_enable(parent: str, base: str) -> frozenset[str]:
    """Delegate the limit controllers to the base's children where the tree
    allows it (best effort: a parent holding processes refuses)."""
    with contextlib.suppress(OSError):
        offered = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
        wanted = set(_read(os.path.join(parent, "cgroup.controllers")).split()) & set(V2_LIMITS)
        for name in wanted - offered:
            with contextlib.suppress(OSError):
                _write(os.path.join(parent, "cgroup.subtree_control"), f"+{name}")
    enabled: set[str] = set()
    with contextlib.suppress(OSError):
        for name in set(_read(os.path.join(base, "cgroup.controllers")).split()) & set(V2_LIMITS):
            with contextlib.suppress(OSError):
                _write(os.path.join(base, "cgroup.subtree_control"), f"+{name}")
                enabled.add(name)
    return frozenset(enabled)


def probe(scope: str) -> Layout | None:
    """The layout of the runtime `scope` on this host (its base directories
    made), or None when no hierarchy can hold and kill a job's group."""
    try:
        mounts = _mounts()
        own_v2, own_v1 = _own_paths()
    except OSError:
        return None
    kill: str | None = None
    freezer: str | None = None
    limits: dict[str, str] = {}
    v2: set[str] = set()
    for fstype, mount, root, _options in mounts:
        if fstype != "cgroup2" or own_v2 is None or kill is not None:
            continue
        parent = _join_path(mount, root, own_v2)
        base = _make_base(parent, scope) if parent else None
        if parent and base and os.path.exists(os.path.join(base, "cgroup.kill")):
            kill = base
            v2.add(base)
            for name in _v2_enable(parent, base):
                limits[name] = base
    for fstype, mount, root, options in mounts:
        if fstype != "cgroup":
            continue
        for name in V1_CONTROLLERS:
            if name not in options or name in limits or (name == "freezer" and freezer):
                continue
            path = own_v1.get(name)
            parent = _join_path(mount, root, path) if path is not None else None
            base = _make_base(parent, scope) if parent else None
            if base is None:
                continue
            if name == "freezer":
                freezer = base
            else:
                limits[name] = base
    if kill is None and freezer is None:
        return None
    return Layout(kill=kill, freezer=freezer if kill is None else None, limits=limits,
                  v2=frozenset(v2))


def _set_limits(group: Group, limits: Limits) -> None:
    layout = group.layout
    writes: list[tuple[str, str, str]] = []  # (controller, file, value)
    if limits.processes and "pids" in layout.limits:
        writes.append(("pids", "pids.max", str(limits.processes)))
    if limits.memory_bytes and "memory" in layout.limits:
        if layout.limits["memory"] in layout.v2:
            writes += [("memory", "memory.max", str(limits.memory_bytes)),
                       ("memory", "memory.swap.max", "0")]
        else:
            writes += [("memory", "memory.limit_in_bytes", str(limits.memory_bytes)),
                       ("memory", "memory.memsw.limit_in_bytes", str(limits.memory_bytes))]
    if limits.cpu_weight and "cpu" in layout.limits:
        if layout.limits["cpu"] in layout.v2:
            writes.append(("cpu", "cpu.weight", str(limits.cpu_weight)))
        else:
            writes.append(("cpu", "cpu.shares",
                           str(max(2, int(limits.cpu_weight * V1_CPU_SHARES_PER_WEIGHT)))))
    for controller, name, value in writes:
        path = os.path.join(layout.limits[controller], group.name, name)
        try:
            _write(path, value)
        except FileNotFoundError:
            continue  # memsw/swap.max without swap accounting: the memory limit holds
        except OSError as exc:
            raise CgroupError(f"cannot set {path} to {value}: {exc.strerror}") from exc


def create(layout: Layout, name: str, limits: Limits) -> Group:
    """A new empty group `name` with `limits` (one left over by an earlier
    start of the same job is killed first)."""
    group = Group(name, layout)
    if members(group):
        kill(group)
    for base in layout.v2 - {b for b in layout.bases if os.path.isdir(b)}:  # released: again
        with contextlib.suppress(OSError):
            os.makedirs(base, mode=0o755, exist_ok=True)
            for controller in sorted(c for c, b in layout.limits.items() if b == base):
                _write(os.path.join(base, "cgroup.subtree_control"), f"+{controller}")
    for path in group.dirs():
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as exc:
            remove(group)
            raise CgroupError(f"cannot make the job's group {path}: {exc.strerror}") from exc
    try:
        _set_limits(group, limits)
    except CgroupError:
        remove(group)
        raise
    return group


def join(group: Group, pid: int) -> None:
    """Move `pid` (parked at its start gate) into every directory of the group."""
    for path in group.dirs():
        try:
            _write(os.path.join(path, "cgroup.procs"), str(pid))
        except OSError as exc:
            raise CgroupError(f"cannot move pid {pid} into {path}: {exc.strerror}") from exc


def members(group: Group) -> list[int]:
    """Every process in the group (any of its directories)."""
    found: set[int] = set()
    for path in group.dirs():
        with contextlib.suppress(OSError, ValueError):
            found.update(int(p) for p in _read(os.path.join(path, "cgroup.procs")).split())
    return sorted(found)


def kill(group: Group) -> None:
    """SIGKILL every process of the group, those it forks meanwhile included."""
    layout = group.layout
    if layout.kill is not None:
        with contextlib.suppress(FileNotFoundError):
            _write(os.path.join(layout.kill, group.name, "cgroup.kill"), "1")
        return
    freezer = os.path.join(layout.freezer, group.name) if layout.freezer else None
    if freezer is not None:
        with contextlib.suppress(FileNotFoundError):
            _write(os.path.join(freezer, "freezer.state"), "FROZEN")
            deadline = time.monotonic() + FREEZE_WAIT_S
            while (_read(os.path.join(freezer, "freezer.state")).strip() != "FROZEN"
                   and time.monotonic() < deadline):
                time.sleep(0.001)  # the kernel freezes each task in turn: no event to wait on
    try:
        for _ in range(10):  # a frozen group cannot fork: one pass is enough then
            pids = members(group)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if freezer is not None:
                break
    finally:
        if freezer is not None:
            with contextlib.suppress(FileNotFoundError):
                _write(os.path.join(freezer, "freezer.state"), "THAWED")


def remove(group: Group) -> bool:
    """Remove the group's directories; False while a member is still there."""
    done = True
    for path in group.dirs():
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
            done = False
    return done


def names(layout: Layout) -> set[str]:
    """The names of every group of the runtime (in any of its hierarchies)."""
    found: set[str] = set()
    for base in layout.bases:
        with contextlib.suppress(OSError):
            found.update(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
    return found


def end_orphans(layout: Layout, keep: set[str]) -> list[str]:
    """Kill and remove every group of the runtime not in `keep` (the running
    jobs procs re-attached): what a previous run left. Returns their names."""
    ended = []
    for name in sorted(names(layout) - keep):
        group = Group(name, layout)
        kill(group)
        ended.append(name)
        remove(group)  # a member being killed may hold it a moment: retried at the end
    return ended


def release(layout: Layout) -> None:
    """Remove the runtime's base directories where no group is left in them."""
    for base in layout.bases:
        with contextlib.suppress(OSError):
            os.rmdir(base)


def sandbox_inner(pid: int) -> bool:
    """`pid` runs inside a pid namespace below ours and is not its init
    (bwrap's pid 1): a program of the sandbox, not its keeper."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) > 1 and ids[-1] != "1"
    except OSError:
        return False
    return False
