"""Tree objects: one directory of a workspace at one moment, as git's trees.

`decode` refuses names that are not plain and unknown modes.
See docs/trees.md ("Trees").
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from broker import compactjson
from broker.errors import CorralError

FORMAT_VERSION = 1
LINK_MODE = 0o120000
DIR_MODE = 0o040000


class TreeFormatError(CorralError):
    """A tree object that does not parse or names an entry that is not plain."""


@dataclass(frozen=True)
class Entry:
    mode: int
    digest: str
    size: int

    @property
    def is_dir(self) -> bool:
        return self.mode == DIR_MODE


Entries = dict[str, Entry]  # name (or path, flattened) -> entry


def encode(entries: Entries) -> bytes:
    return encode_rows(encode_row(name, e.mode, e.digest, e.size)
                       for name, e in sorted(entries.items()))


def encode_row(name: str, mode: int, digest: str, size: int) -> str:
    """One entry as `encode` writes it inside the entries list: a capture keeps
    these per name and joins them (`encode_rows`) instead of encoding every
    entry of a directory again when one changed.

    A name that is not UTF-8 on disk comes as Python's surrogate escapes
    (os.fsdecode); its row is written with JSON's \\u escapes, which decode
    back to the same str, so the name goes back to the disk byte for byte."""
    try:  # json's bytes, on orjson (broker/compactjson.py: the same for str and int)
        return compactjson.dumps([name, mode, digest, size]).decode()
    except UnicodeEncodeError:
        return json.dumps([name, mode, digest, size], separators=(",", ":"))


def encode_rows(rows: Iterable[str]) -> bytes:
    """The tree object whose entries are `rows` (from `encode_row`, sorted by
    name): the very bytes `encode` gives for those entries."""
    return f'{{"entries":[{",".join(rows)}],"version":{FORMAT_VERSION}}}'.encode()


def plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\x00" not in name


def decode(data: bytes) -> Entries:
    try:
        doc = json.loads(data)
        if doc.get("version") != FORMAT_VERSION:
            raise TreeFormatError(f"tree version {doc.get('version')!r} is not {FORMAT_VERSION}")
        out: Entries = {}
        for name, mode, digest, size in doc["entries"]:
            if not (isinstance(name, str) and plain_name(name) and isinstance(mode, int)
                    and isinstance(digest, str) and len(digest) == 64 and isinstance(size, int)):
                raise TreeFormatError(f"tree entry {str(name)[:80]!r} is not valid")
            if not (stat.S_ISREG(mode) or mode in (LINK_MODE, DIR_MODE)):
                raise TreeFormatError(f"tree entry {name[:80]!r} has mode {mode:o}")
            out[name] = Entry(mode, digest, size)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TreeFormatError(f"tree object does not parse: {type(exc).__name__}") from exc
    return out


Load = Callable[[str], bytes]  # digest -> the object's checked bytes
MAX_DEPTH = 256


def flatten(load: Load, digest: str, prefix: str = "", depth: int = 0) -> Entries:
    """Every file and link below the tree `digest`, by workspace-relative path."""
    if depth > MAX_DEPTH:
        raise TreeFormatError(f"tree deeper than {MAX_DEPTH} levels")
    out: Entries = {}
    for name, entry in decode(load(digest)).items():
        if entry.is_dir:
            out.update(flatten(load, entry.digest, f"{prefix}{name}/", depth + 1))
        else:
            out[prefix + name] = entry
    return out


def diff(load: Load, current: str | None, target: str | None, prefix: str = "",
         depth: int = 0) -> tuple[list[str], Entries]:
    """(paths to remove, path -> entry to write) that turn tree `current` into
    `target`, descending only into directories whose digests differ."""
    if current == target:
        return [], {}
    if depth > MAX_DEPTH:
        raise TreeFormatError(f"tree deeper than {MAX_DEPTH} levels")
    cur = decode(load(current)) if current is not None else {}
    tgt = decode(load(target)) if target is not None else {}
    remove: list[str] = []
    write: Entries = {}
    for name in sorted(cur.keys() | tgt.keys()):
        a, b = cur.get(name), tgt.get(name)
        if a == b:
            continue
        path = prefix + name
        if (a is not None and a.is_dir) or (b is not None and b.is_dir):
            sub_a = a.digest if a is not None and a.is_dir else None
            sub_b = b.digest if b is not None and b.is_dir else None
            r, w = diff(load, sub_a, sub_b, path + "/", depth + 1)
            remove += r
            write.update(w)
            if a is not None and not a.is_dir:
                remove.append(path)  # a file or link becomes a directory
            if b is not None and not b.is_dir:
                write[path] = b  # a directory becomes a file or link
            continue
        if a is not None and (b is None or a.mode != b.mode):
            remove.append(path)
        if b is not None:
            write[path] = b
    return remove, write
