"""`python -m actors.changesets {show,apply} DIR ...`: one change set by hand.

Exit codes: 0 applied (or shown), 1 refused (the bound is printed), 2 usage.
See docs/changesets.md ("Applying (`apply.py`)").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import zmq

from actors.changesets.apply import Record, apply
from actors.changesets.manifest import load, load_receipt
from actors.writer.client import WriterClient
from broker.errors import ChangeSetRefusedError
from broker.statedir import StateDir

EXIT_REFUSED = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.changesets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show")
    show.add_argument("directory", type=Path)
    do = sub.add_parser("apply")
    do.add_argument("directory", type=Path)
    do.add_argument("--workspace", type=Path, required=True)
    do.add_argument("--state-dir", default=None)
    do.add_argument("--stream", default="changesets")
    args = parser.parse_args(argv)
    if args.command == "show":
        receipt = load_receipt(args.directory)
        print(json.dumps({"manifest": load(args.directory).model_dump(),
                          "receipt": receipt.model_dump() if receipt else None}, indent=1))
        return 0
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    writer = (WriterClient(ctx, StateDir.at(args.state_dir), "changesets")
              if args.state_dir else None)
    record: Record | None = None
    if writer is not None:
        client = writer

        def record(event: str, payload: dict[str, Any], key: str) -> None:
            client.append(args.stream, event, payload, key=key)
    try:
        receipt = apply(args.directory, args.workspace, record)
    except ChangeSetRefusedError as exc:
        print(f"refused: {exc.bound}: {exc.detail}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        if writer is not None:
            writer.close()
        ctx.destroy(linger=0)
    print(receipt.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
