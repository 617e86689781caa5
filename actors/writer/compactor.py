"""The child process that rewrites one sealed segment off the writer's GIL.

`python -m actors.writer.compactor PURGED_JSON RESULT FIRST_SEQ:SEGMENT...`;
exit 0, or 1 with the error on stderr. It runs at nice 19 and the idle I/O
class so the writer's appends come first. See docs/storage.md ("Compaction").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from actors.writer.compaction import rewrite, to_dict
from actors.writer.wal import WalRecord

# ioprio_set(2) on Linux: IOPRIO_WHO_PROCESS, the idle class (3) in the top bits
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13


def yield_to_writer() -> None:
    """Lowest CPU priority, and the idle I/O class where there is one (best
    effort: a kernel or machine without ioprio_set keeps the default)."""
    os.nice(19 - os.nice(0))
    number = _IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return
    try:
        import ctypes  # noqa: PLC0415 - only in this child

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(number, _IOPRIO_WHO_PROCESS, 0,
                     _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)
    except (OSError, AttributeError):
        return


def main(argv: list[str]) -> int:
    purged_json, result, *segments = argv
    purged: dict[str, list[list[int]]] = json.loads(purged_json)

    def drop(record: WalRecord) -> bool:
        return any(a <= record.seq <= b for a, b in purged.get(record.stream, ()))

    yield_to_writer()  # the appenders' work first
    try:
        out = []
        for item in segments:
            first, _, segment = item.partition(":")
            out.append(to_dict(rewrite(int(first), Path(segment), drop)))
        Path(result).write_bytes(json.dumps(out, separators=(",", ":")).encode())
    except Exception as exc:  # noqa: BLE001 - reported to the writer by the exit code
        print(f"compactor: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
