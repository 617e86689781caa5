"""The child process that rewrites one sealed segment off the writer's GIL.

`python -m actors.writer.compactor PURGED_JSON RESULT FIRST_SEQ:SEGMENT...`;
exit 0, or 1 with the error on stderr. See docs/storage.md ("Compaction").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from actors.writer.compaction import rewrite, to_dict
from actors.writer.wal import WalRecord


def main(argv: list[str]) -> int:
    purged_json, result, *segments = argv
    purged: dict[str, list[list[int]]] = json.loads(purged_json)

    def drop(record: WalRecord) -> bool:
        return any(a <= record.seq <= b for a, b in purged.get(record.stream, ()))

    os.nice(5)  # the appenders' work first
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
