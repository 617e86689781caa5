"""The sandbox every command and terminal of procs runs in (bubblewrap).

A hidden file is bound over by an empty read-only file (`mask_file`); fails
closed when bwrap cannot build it. See docs/security.md ("Commands and
terminals: the sandbox").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from actors.procs import seccomp

HOSTNAME_PREFIX = "corral-"
SANDBOX_TMP = "/tmp"  # noqa: S108 - the sandbox's private tmpfs, not the host's
# Names copied from procs' environment into a program's, when set there.
ENV_ALLOW: tuple[str, ...] = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE",
                              "LC_MESSAGES", "LC_COLLATE", "LC_NUMERIC", "TZ")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
ENV_EXE = "/usr/bin/env"
CHECK_TIMEOUT_S = 10.0


class SandboxUnavailableError(Exception):
    """The sandbox cannot be built (bwrap missing or failing its self-check)."""


@dataclass(frozen=True)
class SandboxPolicy:
    """What configuration decides (`sandbox:` in config/default.yaml)."""

    enabled: bool = True  # False only by explicit `mode: off`
    network: tuple[str, ...] = ()  # fnmatch patterns of sessions whose programs get the network
    hide: tuple[str, ...] = ("/run",)  # host paths hidden under an empty tmpfs
    bwrap: str = "bwrap"  # the executable (looked up on PATH)
    cgroups: bool = True  # False only by explicit `cgroups: off`: jobs may then run ungrouped
    tmp_bytes: int = 256 * 1024 * 1024  # the sandbox's /tmp, a tmpfs of this size (0: unsized)
    seccomp_program: bytes = b""  # the filter (actors/procs/seccomp.py), set by check()

    def network_for(self, session: str) -> bool:
        return any(fnmatch.fnmatchcase(session, pattern) for pattern in self.network)


@dataclass(frozen=True)
class Confinement:
    """One job's view: its workspace (the only writable place besides /tmp),
    what is hidden, and whether it has the network."""

    workspace: str
    hidden: tuple[str, ...]  # directories: an empty read-only tmpfs each
    network: bool = False
    masked: tuple[str, ...] = ()  # files: `mask` (an empty file) bound over each
    mask: str = ""  # the empty file (mask_file), needed when `masked` is not empty


MASK_NAME = "sandbox-mask"


def mask_file(run_dir: str) -> str:
    """An empty read-only file in `run_dir` (procs' own, hidden from every
    command), bound over each hidden file; made again if it is not empty."""
    path = os.path.join(run_dir, MASK_NAME)
    try:
        if os.lstat(path).st_size == 0 and not os.path.islink(path):
            return path
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    os.close(fd)
    return path


def _under(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip("/") + "/")


def split_hidden(paths: tuple[str, ...], workspace: str | None = None,
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The existing `paths` resolved (a symlink hides its target) and split
    into directories (hidden under a tmpfs) and other files (masked by an
    empty file); a file inside a hidden directory is not there to mask,
    unless it lies in the `workspace`, which is bound back inside it."""
    real = [os.path.realpath(p) for p in paths if os.path.lexists(p)]
    dirs = tuple(dict.fromkeys(p for p in real if os.path.isdir(p)))
    files = tuple(dict.fromkeys(
        p for p in real if os.path.exists(p) and not os.path.isdir(p)
        and ((workspace is not None and _under(p, workspace))
             or not any(_under(p, d) for d in dirs))))
    return dirs, files


def clean_env(base: Mapping[str, str], *, term: str | None = None) -> dict[str, str]:
    """A program's environment: the allow-listed names of `base`, HOME and
    TMPDIR on the private /tmp, TERM for terminals. Nothing else."""
    env = {name: base[name] for name in ENV_ALLOW if name in base}
    env.setdefault("PATH", DEFAULT_PATH)
    env["HOME"] = SANDBOX_TMP
    env["TMPDIR"] = SANDBOX_TMP
    if term is not None:
        env["TERM"] = term
    return env


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


@functools.cache
def runtime_paths() -> tuple[str, ...]:
    """corral's own Python (the environment's prefix and its import paths) where
    it lies under /tmp, which the sandbox replaces with a private tmpfs: bound
    back read-only, so a command can run the interpreter the runtime runs on
    (a checkout or virtual environment under /tmp, as in CI)."""
    tmp = SANDBOX_TMP + "/"
    found = sorted({os.path.realpath(p) for p in (sys.prefix, *sys.path)
                    if p and os.path.realpath(p).startswith(tmp)
                    and os.path.isdir(os.path.realpath(p))})
    kept: list[str] = []
    for path in found:  # parents first: a path inside a kept one is already there
        if not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return tuple(kept)


def seccomp_fd(policy: SandboxPolicy) -> int | None:
    """A fresh inheritable descriptor holding the policy's seccomp filter, read
    from its start by the job's bwrap (`--seccomp FD`); the caller closes it
    once the job is spawned. None without a filter (the sandbox off)."""
    if not policy.enabled or not policy.seccomp_program:
        return None
    fd = os.memfd_create("corral-seccomp", 0)
    try:
        os.write(fd, policy.seccomp_program)
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
    except OSError:
        os.close(fd)
        raise
    return fd


def bwrap_argv(policy: SandboxPolicy, confinement: Confinement, cwd: str,
               env: Mapping[str, str], name: str, *, seccomp: int | None = None) -> list[str]:
    """The bwrap prefix (ends with `--`) that confines a program to
    `confinement`, with the seccomp filter read from the descriptor `seccomp`;
    the sandbox's hostname is `corral-<name>`."""
    argv = [policy.bwrap, "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--hostname", f"{HOSTNAME_PREFIX}{name}", "--unshare-cgroup-try"]
    if not confinement.network:
        argv.append("--unshare-net")
    argv += ["--die-with-parent", "--cap-drop", "ALL",
             "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    # parents before children: a bind inside a hidden directory must come after
    # its tmpfs, a directory hidden inside the workspace after the workspace
    mounts: list[tuple[str, str]] = [("--tmpfs", SANDBOX_TMP)]
    mounts += [("--ro-bind", path) for path in runtime_paths()]
    mounts += [("--tmpfs", path) for path in confinement.hidden]
    mounts.append(("--bind", confinement.workspace))
    mounts += [("mask", path) for path in confinement.masked]
    for flag, path in sorted(mounts, key=lambda m: _depth(m[1])):
        if flag == "--tmpfs" and path == SANDBOX_TMP and policy.tmp_bytes:
            argv += ["--size", str(policy.tmp_bytes), flag, path]
        elif flag == "--tmpfs":
            argv += [flag, path]
        elif flag == "mask":  # reads as empty, cannot be written or removed
            argv += ["--ro-bind", confinement.mask, path]
        else:
            argv += [flag, path, path]
    for path in confinement.hidden:  # empty and read-only (not recursive: a workspace inside stays)
        argv += ["--remount-ro", path]
    if seccomp is not None:
        argv += ["--seccomp", str(seccomp)]
    argv += ["--chdir", cwd, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv.append("--")
    return argv


def check(policy: SandboxPolicy, state_root: str) -> SandboxPolicy:
    """Build a sandbox like a job's and run a probe in it; return the policy
    with bwrap's absolute path, or raise SandboxUnavailableError naming what
    is missing or what failed."""
    found = shutil.which(policy.bwrap)
    if found is None:
        raise SandboxUnavailableError(
            f"the command sandbox needs bubblewrap: {policy.bwrap!r} was not found on PATH "
            "(Debian/Ubuntu: apt-get install bubblewrap); or set `sandbox: {mode: off}` in "
            "the configuration to run commands unconfined")
    try:
        policy = dataclasses.replace(policy, bwrap=found, seccomp_program=seccomp.program())
    except seccomp.UnsupportedArchError as exc:
        raise SandboxUnavailableError(f"{exc}: the sandbox's seccomp filter cannot be built; "
                                      "set `sandbox: {mode: off}` to run commands "
                                      "unconfined") from exc
    with tempfile.TemporaryDirectory(prefix="corral-sandbox-check-") as workspace:
        hidden, masked = split_hidden((state_root, *policy.hide))
        confinement = Confinement(workspace=workspace, hidden=hidden, masked=masked,
                                  mask=mask_file(workspace) if masked else "")
        fd = seccomp_fd(policy)
        argv = [*prefix(policy, confinement, workspace, clean_env(os.environ), "check", seccomp=fd),
                "/bin/sh",
                "-c", "touch ./probe && ! touch /probe 2>/dev/null"]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=CHECK_TIMEOUT_S,
                                  check=False, env={}, pass_fds=() if fd is None else (fd,))
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailableError(f"bubblewrap self-check failed: {exc}") from exc
        finally:
            if fd is not None:
                os.close(fd)
        if done.returncode != 0 or not os.path.exists(os.path.join(workspace, "probe")):
            detail = done.stderr.decode("utf-8", "replace").strip()[:300]
            raise SandboxUnavailableError(
                f"bubblewrap self-check failed (exit {done.returncode}): {detail or 'no output'}; "
                "user and pid namespaces are needed (as root, or unprivileged user namespaces "
                "enabled)")
    return policy


def prefix(policy: SandboxPolicy, confinement: Confinement, cwd: str,
           env: Mapping[str, str], name: str, *, seccomp: int | None = None) -> list[str]:
    """The argv prefix that runs a program in the sandbox with exactly `env`.
    It must be exec'd with an *empty* environment: bwrap's copy is the
    sandbox's pid 1, whose environ a program reads as /proc/1/environ. With
    the policy off, `env -i` replaces the environment and nothing else."""
    if not policy.enabled:
        return [ENV_EXE, "-i", *(f"{k}={v}" for k, v in env.items())]
    return bwrap_argv(policy, confinement, cwd, env, name, seccomp=seccomp)
