"""Tree objects: one directory of a workspace at one moment, as git's trees.

`decode` refuses names that are not plain and unknown modes. A large
directory is split into content-defined parts under a version 2 node
(`read` gives a directory's entries in either form, `links` what an object
names). See docs/trees.md ("Trees").
"""

from __future__ import annotations

import hashlib
import json
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from broker import compactjson
from broker.errors import CorralError

FORMAT_VERSION = 1
SPLIT_VERSION = 2  # a node of a split directory: its parts' digests
SPLIT_BYTES = 4096  # a directory whose one object would be larger is split
# a part ends after an entry whose name hashes to 0 modulo CHUNK_SPREAD, holding
# CHUNK_MIN entries at least and CHUNK_MAX at most; the same for nodes, by the
# last name below each part, with other bits of the hash at each level
CHUNK_MIN, CHUNK_SPREAD, CHUNK_MAX = 3, 6, 12
MAX_PART_DEPTH = 16  # levels of nodes read below one directory
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
    """The entries of a version 1 object (a whole directory, or one part of a
    split one); a node of a split directory is refused: `read` joins it."""
    got = _parse(data)
    if isinstance(got, list):
        raise TreeFormatError("tree object is a node of parts: read it with its parts")
    return got


def links(data: bytes) -> tuple[Entries, list[str]]:
    """What one tree object names: its entries (a version 1 object), or the
    parts of a split directory's node (each itself a tree object)."""
    got = _parse(data)
    return ({}, got) if isinstance(got, list) else (got, [])


def _parse(data: bytes) -> Entries | list[str]:
    try:
        doc = json.loads(data)
        version = doc.get("version")
        if version == SPLIT_VERSION:
            parts = doc["parts"]
            if not (isinstance(parts, list) and parts and all(
                    isinstance(d, str) and len(d) == 64 for d in parts)):
                raise TreeFormatError("tree node's parts are not valid")
            return parts
        if version != FORMAT_VERSION:
            raise TreeFormatError(f"tree version {version!r} is not {FORMAT_VERSION}")
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


def read(load: Load, digest: str) -> Entries:
    """The entries of the directory whose tree is `digest`, in either form
    (one object, or a node of parts: joined, their names in strictly
    increasing order from part to part)."""
    return _join(leaves(load, digest))


def _join(parts: Iterable[tuple[str, bytes]]) -> Entries:
    out: Entries = {}
    last = ""  # the greatest name read so far
    for _, data in parts:
        entries = decode(data)
        if not entries:
            continue
        if last and min(entries) <= last:
            raise TreeFormatError("tree parts are not in name order")
        last = max(entries)
        out.update(entries)
    return out


def leaves(load: Load, digest: str) -> list[tuple[str, bytes]]:
    """The version 1 objects (digest, bytes) that hold the directory
    `digest`'s entries, in name order: itself when it is one object. Only
    the nodes are parsed here (a leaf is whatever is not a node: `decode`
    refuses it if it is not a version 1 object)."""
    out: list[tuple[str, bytes]] = []
    todo = [(digest, 0)]
    while todo:
        d, depth = todo.pop()
        data = load(d)
        parts = links(data)[1] if data.startswith(b'{"parts"') else []
        if not parts:
            out.append((d, data))
            continue
        if depth >= MAX_PART_DEPTH:
            raise TreeFormatError(f"tree node deeper than {MAX_PART_DEPTH} levels")
        todo.extend((p, depth + 1) for p in reversed(parts))
    return out


def digest_of_entries(entries: Entries) -> str:
    """The digest `store_rows` gives a directory holding `entries`."""
    return store_rows(sorted(entries), {name: encode_row(name, e.mode, e.digest, e.size)
                                        for name, e in entries.items()}, {})


def store_rows(order: Sequence[str], rows: Mapping[str, str], out: dict[str, bytes]) -> str:
    """The tree of a directory whose entries' rows (`encode_row`) are `rows`,
    `order` their names sorted: its objects added to `out` (digest -> bytes)
    and its digest returned. One version 1 object when that is at most
    `SPLIT_BYTES` long, else parts and nodes (the module's docstring)."""
    listed = [rows[name] for name in order]
    body = encode_rows(listed)
    if len(body) <= SPLIT_BYTES:
        digest = hashlib.sha256(body).hexdigest()
        out.setdefault(digest, body)
        return digest
    keys = [_KEYS.get(name) or _key(name) for name in order]
    items: list[tuple[int, str]] = []  # (key of the last name below, digest)
    start = 0
    for end in _ends(keys, 0):
        body = encode_rows(listed[start:end])
        digest = hashlib.sha256(body).hexdigest()
        out.setdefault(digest, body)
        items.append((keys[end - 1], digest))
        start = end
    level = 1
    while len(items) > 1:
        nodes = []
        start = 0
        for end in _ends([k for k, _ in items], level):
            body = _encode_node([d for _, d in items[start:end]])
            digest = hashlib.sha256(body).hexdigest()
            out.setdefault(digest, body)
            nodes.append((items[end - 1][0], digest))
            start = end
        items, level = nodes, level + 1
    return items[0][1]


def _encode_node(parts: list[str]) -> bytes:
    listed = '","'.join(parts)
    return f'{{"parts":["{listed}"],"version":{SPLIT_VERSION}}}'.encode()


_KEYS: dict[str, int] = {}  # name -> the hash its part's end follows (a memo)


def _key(name: str) -> int:
    if len(_KEYS) >= 1 << 17:
        _KEYS.clear()
    raw = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    key = _KEYS[name] = int.from_bytes(raw, "big")
    return key


def _ends(keys: list[int], level: int) -> list[int]:
    """Where the parts of `keys` (one per entry, or per part below) end: after
    a key whose byte for `level` is 0 modulo CHUNK_SPREAD, within CHUNK_MIN
    and CHUNK_MAX (past the hash's 8 bytes, every CHUNK_MIN)."""
    shift = 8 * level
    ends: list[int] = []
    start = 0
    n = len(keys)
    for i in [i for i, k in enumerate(keys) if not ((k >> shift) & 0xFF) % CHUNK_SPREAD]:
        while i + 1 - start > CHUNK_MAX:
            start += CHUNK_MAX
            ends.append(start)
        if i + 1 - start >= CHUNK_MIN:
            start = i + 1
            ends.append(start)
    while n - start > CHUNK_MAX:
        start += CHUNK_MAX
        ends.append(start)
    if start < n:
        ends.append(n)
    return ends


def flatten(load: Load, digest: str, prefix: str = "", depth: int = 0) -> Entries:
    """Every file and link below the tree `digest`, by workspace-relative path."""
    if depth > MAX_DEPTH:
        raise TreeFormatError(f"tree deeper than {MAX_DEPTH} levels")
    out: Entries = {}
    for name, entry in read(load, digest).items():
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
    # the parts both directories share hold the same entries: only the others
    # are read and compared
    parts_a = leaves(load, current) if current is not None else []
    parts_b = leaves(load, target) if target is not None else []
    shared = {d for d, _ in parts_a} & {d for d, _ in parts_b}
    cur = _join(p for p in parts_a if p[0] not in shared)
    tgt = _join(p for p in parts_b if p[0] not in shared)
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
