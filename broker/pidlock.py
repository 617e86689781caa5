"""An exclusive lock file with the holder's pid inside (`run/<actor>.lock`).

flock(2): the kernel releases it when the holder dies. See docs/supervisor.md
("Process tree").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from broker.errors import LockHeldError


def pid_alive(pid: int) -> bool:
    """True when some process (a zombie included) holds `pid` now."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(path: Path) -> int | None:
    """The pid written in the lock file, if any."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def is_held(path: Path) -> bool:
    """True when a live process holds the lock (probed without keeping it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class PidLock:
    """Held for the holder's whole life; the fd is close-on-exec."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockHeldError naming the holder's pid."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeldError(self.path, read_holder(self.path)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None
