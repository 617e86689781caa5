"""The supervisor's control socket: a ROUTER at run/supervisor.sock.

Children's ControlReporter DEALERs (identity = child name) send `ready` and
`heartbeat`; the CLI sends status, signal, restart and stop requests through a
Requester and gets `status_reply`, `ack` or `error`. A frame that does not
decode is answered with an `error` and logged; it never stops the loop.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import structlog
import zmq

from broker import protocol
from broker.errors import ProtocolError
from broker.statedir import StateDir, bind_umask

log = structlog.get_logger("supervisor.control")
MAX_PER_TURN = 2000  # frames handled per loop turn, so timers still run under load


@dataclass(frozen=True)
class Incoming:
    identity: bytes
    message: protocol.Message


class ControlServer:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], state_dir: StateDir) -> None:
        self.endpoint = state_dir.endpoint("supervisor")
        path = self.endpoint.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of a dead supervisor (we hold the lock)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.DEFAULT_LIMITS.max_frame_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        old = bind_umask()
        try:
            self.sock.bind(self.endpoint)
        finally:
            os.umask(old)
        self.rejected_total = 0

    def receive(self) -> list[Incoming]:
        """Every decodable message waiting now (bounded per call)."""
        out: list[Incoming] = []
        for _ in range(MAX_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                self.rejected_total += 1
                log.warning("frame_rejected", frames=len(frames), reason="expected 2 frames")
                continue
            identity, frame = frames
            try:
                out.append(Incoming(identity, protocol.decode(frame)))
            except ProtocolError as exc:
                self.rejected_total += 1
                log.warning("frame_rejected", sender=identity[:64].hex(), code=exc.code,
                            detail=exc.detail)
                self.send(identity, protocol.error_frame(exc, protocol.peek_msg_id(frame)))
        return out

    def reply(self, identity: bytes, message: protocol.StatusReply | protocol.Ack
              | protocol.Error | protocol.ReloadReply) -> None:
        self.send(identity, protocol.encode(message))

    def send(self, identity: bytes, frame: bytes) -> None:
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=0)
        with contextlib.suppress(OSError):
            os.unlink(self.endpoint.removeprefix("ipc://"))
