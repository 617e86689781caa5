"""A test peer in its own process: answers every `ping` routed to it with a
`pong` carrying its pid, until SIGTERM.

    python -m tests.broker_echo --state-dir D --name NAME [--heartbeat-interval-ms 100]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType

import zmq

from broker import logconfig, protocol
from broker.peer import BrokerPeer
from broker.statedir import StateDir


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--heartbeat-interval-ms", type=int, default=100)
    parser.add_argument("--heartbeat-misses", type=int, default=3)
    args = parser.parse_args()
    state = StateDir.at(args.state_dir)
    logconfig.configure(args.name, state.log_path(args.name), console=False)
    stopping = False

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(
        ctx, state, args.name, args.heartbeat_interval_ms / 1000.0, args.heartbeat_misses
    )
    pid = os.getpid()
    try:
        while not stopping:
            item = peer.recv(0.05)
            if item is None:
                continue
            sender, message = item
            if isinstance(message, protocol.Ping):
                peer.send(sender, protocol.Pong(msg_id=message.msg_id, actor=args.name, pid=pid))
    finally:
        peer.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
