"""Rendering a git-format patch, binary-safe, that `git apply` accepts.

See docs/changesets.md ("Building").
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import zlib
from dataclasses import dataclass

ZERO_ID = "0" * 40
CONTEXT_LINES = 3


def blob_id(data: bytes) -> str:
    """git's object id of a blob with this content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class FileDiff:
    path: str
    before: bytes | None  # None: added
    after: bytes | None  # None: deleted
    before_mode: int | None  # 0o100644 or 0o100755
    after_mode: int | None


def _quote(prefix: str, path: str) -> str:
    name = prefix + path
    if '"' in name or "\\" in name:
        return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return name


def is_binary(data: bytes | None) -> bool:
    return data is not None and b"\0" in data


def render(diffs: list[FileDiff]) -> bytes:
    out = bytearray()
    for diff in sorted(diffs, key=lambda d: d.path):
        out += _render_one(diff)
    return bytes(out)


def _render_one(d: FileDiff) -> bytes:
    a, b = _quote("a/", d.path), _quote("b/", d.path)
    lines = [f"diff --git {a} {b}"]
    before_id = blob_id(d.before) if d.before is not None else ZERO_ID
    after_id = blob_id(d.after) if d.after is not None else ZERO_ID
    if d.before is None:
        lines.append(f"new file mode {d.after_mode:o}")
        lines.append(f"index {before_id}..{after_id}")
    elif d.after is None:
        lines.append(f"deleted file mode {d.before_mode:o}")
        lines.append(f"index {before_id}..{after_id}")
    elif d.before_mode != d.after_mode:
        lines += [f"old mode {d.before_mode:o}", f"new mode {d.after_mode:o}"]
        if before_id != after_id:
            lines.append(f"index {before_id}..{after_id}")
    else:
        lines.append(f"index {before_id}..{after_id} {d.after_mode:o}")
    head = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
    if before_id == after_id:
        return head
    before, after = d.before or b"", d.after or b""
    if is_binary(d.before) or is_binary(d.after):
        return head + _binary(before, after)
    if not before and not after:
        return head
    old = f"--- {a}" if d.before is not None else "--- /dev/null"
    new = f"+++ {b}" if d.after is not None else "+++ /dev/null"
    return head + f"{old}\n{new}\n".encode("utf-8", "surrogateescape") + _hunks(before, after)


def _range(start: int, length: int) -> str:
    if length == 1:
        return f"{start + 1}"
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def _line(prefix: bytes, line: bytes) -> bytes:
    if line.endswith(b"\n"):
        return prefix + line
    return prefix + line + b"\n\\ No newline at end of file\n"


def _hunks(before: bytes, after: bytes) -> bytes:
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    out = bytearray()
    for group in matcher.get_grouped_opcodes(CONTEXT_LINES):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out += f"@@ -{_range(i1, i2 - i1)} +{_range(j1, j2 - j1)} @@\n".encode()
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                for line in a[a1:a2]:
                    out += _line(b" ", line)
                continue
            for line in a[a1:a2]:
                out += _line(b"-", line)
            for line in b[b1:b2]:
                out += _line(b"+", line)
    return bytes(out)


def _literal(data: bytes) -> bytes:
    packed = zlib.compress(data, 9)
    out = bytearray(b"literal %d\n" % len(data))
    for i in range(0, len(packed), 52):
        chunk = packed[i : i + 52]
        n = len(chunk)
        out += bytes([ord("A") + n - 1 if n <= 26 else ord("a") + n - 27])
        out += base64.b85encode(chunk, pad=True) + b"\n"
    return bytes(out) + b"\n"


def _binary(before: bytes, after: bytes) -> bytes:
    return b"GIT binary patch\n" + _literal(after) + _literal(before)
