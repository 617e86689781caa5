"""A test client process for the full-disk test: appends `count` events under
keys k0..k{count-1}, waiting out `storage_full` refusals (the client resends
under the same key), and journals each acknowledged (key, seq), fsynced, to a
file outside the state directory.

    python -m tests.spaceappender --state-dir D --origin O --count N --journal F
"""

from __future__ import annotations

import argparse
import os
import sys

import zmq

from actors.writer.client import WriterClient
from broker.statedir import StateDir


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--origin", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--pad", type=int, default=1000)
    args = parser.parse_args()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(
        ctx, StateDir.at(args.state_dir), args.origin, timeout_s=0.5, retries=120,
        storage_wait_s=120.0,
    )
    fd = os.open(args.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for i in range(args.count):
            ack = client.append(
                f"agent/{args.origin}", "tool_call", {"i": i, "pad": "x" * args.pad}, key=f"k{i}"
            )
            os.write(fd, f"k{i} {ack.seq}\n".encode())
            os.fsync(fd)
    finally:
        os.close(fd)
        client.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
