"""The layout of a state directory: every path any process uses is named here.

See docs/state-layout.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from broker.errors import StateDirError

DEFAULT_DIRNAME = ".corral"
STATE_DIR_ENV = "CORRAL_STATE_DIR"  # the operator's default (docs/operations.md)

# Actor and stream names become socket identities and file names: keep them tame.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def check_actor_name(name: str) -> str:
    """Return `name` if it is a valid actor name, else raise StateDirError."""
    if not NAME_PATTERN.fullmatch(name):
        raise StateDirError(
            f"invalid actor name {name!r}: use 1-64 of [A-Za-z0-9_.-], starting alphanumeric"
        )
    return name


class StateDir(NamedTuple):  # not a dataclass: `supervisor status` skips importing inspect
    """Paths inside one state directory. Creating it is `ensure()`."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str] | None) -> StateDir:
        """The state directory at `path`, or `./.corral` when None."""
        return cls(Path(path if path is not None else DEFAULT_DIRNAME).resolve())

    @classmethod
    def resolve(cls, path: str | os.PathLike[str] | None,
                environ: Mapping[str, str] | None = None) -> StateDir:
        """The state directory an operator's command means: `--state-dir` when
        given, else `$CORRAL_STATE_DIR` when set and not empty, else `./.corral`.
        Every `supervisor` command resolves it here (docs/supervisor.md)."""
        if path is None:
            path = (os.environ if environ is None else environ).get(STATE_DIR_ENV) or None
        return cls.at(path)

    # --- tiers -------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def wal_dir(self) -> Path:
        return self.state_dir / "wal"

    @property
    def checkpoint_path(self) -> Path:
        return self.state_dir / "wal.checkpoint.json"

    @property
    def budget_ledger_path(self) -> Path:
        return self.state_dir / "budget_ledger.jsonl"

    @property
    def approvals_ledger_path(self) -> Path:
        return self.root / "approvals.jsonl"

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def memory_dir(self) -> Path:
        return self.root / "memory"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def stream_index_dir(self) -> Path:
        return self.cache_dir / "wal-index"

    def agent_dir(self, name: str) -> Path:
        return self.root / "agents" / check_actor_name(name)

    # --- run/ --------------------------------------------------------------
    def endpoint(self, actor: str) -> str:
        """The ipc:// endpoint an actor binds (writer, broker, supervisor)."""
        path = self.run_dir / f"{check_actor_name(actor)}.sock"
        # Linux limits sun_path to 107 bytes; fail with a clear message, not EINVAL.
        if len(os.fsencode(path)) > 107:
            raise StateDirError(
                f"socket path too long for ipc:// ({len(os.fsencode(path))} > 107 bytes): "
                f"{path}; use a shorter --state-dir"
            )
        return f"ipc://{path}"

    @property
    def lock_path(self) -> Path:
        return self.run_dir / "supervisor.lock"

    @property
    def status_path(self) -> Path:
        return self.run_dir / "status.json"

    def log_path(self, actor: str) -> Path:
        return self.logs_dir / f"{check_actor_name(actor)}.log"

    # --- creation ----------------------------------------------------------
    def ensure(self) -> StateDir:
        """Create the directory tree, private: this process's umask becomes
        077 (every file it creates from now on is 0600, every directory 0700)
        and the state directory itself is 0700 whatever it was."""
        private_umask()
        try:
            for d in (
                self.root,
                self.state_dir,
                self.wal_dir,
                self.config_dir,
                self.memory_dir,
                self.logs_dir,
            ):  # cache/ is derived: whoever uses it creates it, and copes without it
                d.mkdir(parents=True, exist_ok=True)
            old = os.umask(0o077)
            try:
                self.run_dir.mkdir(mode=0o700, exist_ok=True)
            finally:
                os.umask(old)
            os.chmod(self.run_dir, 0o700)
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise StateDirError(f"cannot create state directory {self.root}: {exc}") from exc
        return self


PRIVATE_UMASK = 0o077


def private_umask() -> None:
    """Every process of corral creates its files 0600 and directories 0700
    (logs, specs, workspaces, change sets, everything under the state
    directory): called by each main, through `StateDir.ensure()` or directly."""
    os.umask(PRIVATE_UMASK)


def bind_umask() -> int:
    """Set a umask that keeps sockets private before a bind; returns the old one."""
    return os.umask(0o077)

