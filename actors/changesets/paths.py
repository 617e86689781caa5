"""Path rules for change sets (bound `unsafe_path`).

See docs/changesets.md ("Building") and docs/security.md ("File operations,
rules and change sets").
"""

from __future__ import annotations

import contextlib
import unicodedata

from actors.changesets import confined
from broker.errors import ChangeSetRefusedError

MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255
_IGNORABLE = "".join(chr(c) for c in (
    0x200C, 0x200D, 0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E,
    0x206A, 0x206B, 0x206C, 0x206D, 0x206E, 0x206F, 0xFEFF,
))


def _refuse(path: str, detail: str, bound: str = "unsafe_path") -> ChangeSetRefusedError:
    return ChangeSetRefusedError(bound, f"{path!r}: {detail}", path)


def has_format_char(text: str) -> bool:
    """True when `text` holds a Unicode format character (category Cf: bidi
    overrides such as U+202E, zero-width joiners, BOM, ...): such a name can
    show as something else than it is."""
    if text.isascii():  # no ASCII character is a format character: most paths end here
        return False
    return any(unicodedata.category(ch) == "Cf" for ch in text)


def is_git_name(component: str) -> bool:
    cleaned = "".join(ch for ch in component if ch not in _IGNORABLE).rstrip(" .").lower()
    return cleaned in (".git", "git~1")  # git~1: the NTFS short name of .git


def check_path(path: str) -> str:
    """Return `path` if it is a safe change-set path, else raise."""
    if not path:
        raise _refuse(path, "empty path")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise _refuse(path, "path too long")
    if path.startswith("/"):
        raise _refuse(path, "absolute path")
    if "\\" in path:
        raise _refuse(path, "backslash in path")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise _refuse(path, "control character in path")
    if has_format_char(path):
        raise _refuse(path, "an invisible format character (Unicode Cf, e.g. a bidi override)")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise _refuse(path, f"component {part!r}")
        if is_git_name(part):
            raise _refuse(path, "a .git component")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            raise _refuse(path, "component too long")
    if parts[0].lower().rstrip(" .") == ".corral":
        raise _refuse(path, "a path into .corral/")
    return path


def open_root(workspace: str) -> contextlib.AbstractContextManager[int]:
    return confined.open_root(workspace)


def _mapped(path: str, exc: confined.UnsafeFileError) -> ChangeSetRefusedError:
    bound = {"special_file": "special_file", "hard_link": "hard_link",
             "protected": "unsafe_path"}.get(exc.kind, "symlink")
    return _refuse(path, exc.reason, bound)


def read_file(root_fd: int, path: str, guard: confined.Guard = confined.NO_GUARD
              ) -> tuple[bytes, int] | None:
    """(content, st_mode) of a regular file, None if absent; refuses links."""
    try:
        return confined.read(root_fd, check_path(path).split("/"), guard)
    except confined.UnsafeFileError as exc:
        raise _mapped(path, exc) from exc


def write_file(root_fd: int, path: str, data: bytes, mode: int,
               guard: confined.Guard = confined.NO_GUARD) -> None:
    """Replace `path` atomically and durably (confined.write: a random temp
    name made with O_EXCL | O_NOFOLLOW, fsync, rename, fsync of the directory)."""
    try:
        confined.write(root_fd, check_path(path).split("/"), data, guard,
                       mode=0o700 if mode & 0o111 else 0o600)  # private, like all corral writes
    except confined.UnsafeFileError as exc:
        raise _mapped(path, exc) from exc


def delete_file(root_fd: int, path: str, guard: confined.Guard = confined.NO_GUARD) -> None:
    """Remove a regular file (absent is fine: deletes are idempotent)."""
    try:
        confined.delete(root_fd, check_path(path).split("/"), guard)
    except confined.UnsafeFileError as exc:
        raise _mapped(path, exc) from exc
