"""A test client process: appends `count` events under keys k0..k{count-1} and
journals each acknowledged (key, seq) to a file outside the state directory,
flushed and fsynced, so a test can check that nothing acknowledged was lost.
A `storage_full` refusal is waited out (the client resends under the same key)
for up to `--storage-wait-s`: the full-disk test's appenders.

    python -m tests.appender --state-dir D --origin O --count N --journal F
        [--pad BYTES] [--timeout-s S] [--retries N] [--storage-wait-s S]
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
    parser.add_argument("--timeout-s", type=float, default=0.5)
    parser.add_argument("--retries", type=int, default=60)
    parser.add_argument("--pad", type=int, default=200)
    parser.add_argument("--storage-wait-s", type=float, default=300.0)
    args = parser.parse_args()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(
        ctx,
        StateDir.at(args.state_dir),
        args.origin,
        timeout_s=args.timeout_s,
        retries=args.retries,
        storage_wait_s=args.storage_wait_s,
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
