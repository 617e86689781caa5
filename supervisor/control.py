"""The supervisor's control socket: a ROUTER at run/supervisor.sock.

Children's ControlReporter DEALERs (identity = child name) send `ready` and
`heartbeat`; the CLI sends status, signal, restart and stop requests through a
Requester and gets `status_reply`, `ack` or `error`. A frame that does not
decode is answered with an `error` and logged; it never stops the loop.

Every connection authenticates (broker/auth.py; the ZAP handler is served
here, its socket polled by the supervisor loop): `status_request` is answered
to any actor, `ready`/`heartbeat` are taken only from the actor they name, and
every other request (stop, signal, restart, spawn, ...) only from the
operator; a refused request gets an `error` with code `forbidden`. No agent
may be spawned under a reserved name (its credential would be that role's).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import structlog
import zmq

from broker import auth, protocol
from broker.errors import ProtocolError
from broker.statedir import StateDir, bind_umask

log = structlog.get_logger("supervisor.control")
MAX_PER_TURN = 2000  # frames handled per loop turn, so timers still run under load


@dataclass(frozen=True)
class Incoming:
    identity: bytes
    message: protocol.Message
    user: str = auth.OPERATOR  # the authenticated sender (checked by receive())


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
        self.zap = auth.ZapHandler(ctx, auth.ensure_keys(state_dir))
        auth.apply_server(self.sock)
        old = bind_umask()
        try:
            self.sock.bind(self.endpoint)
        finally:
            os.umask(old)
        self.rejected_total = 0
        self.forbidden_total = 0

    def receive(self) -> list[Incoming]:
        """Every decodable message waiting now (bounded per call) that its
        authenticated sender may send; answers pending ZAP requests first."""
        self.zap.handle()
        out: list[Incoming] = []
        for _ in range(MAX_PER_TURN):
            try:
                head = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames = [head.bytes]
            while self.sock.getsockopt(zmq.RCVMORE):
                frames.append(self.sock.recv())
            if len(frames) != 2:
                self.rejected_total += 1
                log.warning("frame_rejected", frames=len(frames), reason="expected 2 frames")
                continue
            identity, frame = frames
            try:
                incoming = Incoming(identity, protocol.decode(frame), auth.user_of(head))
                if self._permitted(incoming):
                    out.append(incoming)
            except ProtocolError as exc:
                self.rejected_total += 1
                log.warning("frame_rejected", sender=identity[:64].hex(), code=exc.code,
                            detail=exc.detail)
                self.send(identity, protocol.error_frame(exc, protocol.peek_msg_id(frame)))
        return out

    def _permitted(self, incoming: Incoming) -> bool:
        msg, user = incoming.message, incoming.user
        refusal = auth.control_refusal(user, msg.kind)
        if refusal is None and isinstance(msg, protocol.Ready | protocol.Heartbeat):
            refusal = auth.name_refusal(user, msg.actor)
        if refusal is None and isinstance(msg, protocol.SpawnRequest) \
                and msg.name in auth.RESERVED:
            refusal = f"{msg.name!r} is a reserved name"
        if refusal is None:
            return True
        self.forbidden_total += 1
        if self.forbidden_total <= 100 or self.forbidden_total % 1000 == 0:
            log.warning("control_refused", user=user, kind=msg.kind, detail=refusal,
                        forbidden_total=self.forbidden_total)
        if not isinstance(msg, protocol.Ready | protocol.Heartbeat):  # those expect no reply
            self.reply(incoming.identity, protocol.Error(
                msg_id=getattr(msg, "msg_id", None), code=protocol.ErrorCode.FORBIDDEN,
                detail=refusal))
        return False

    def reply(self, identity: bytes, message: protocol.StatusReply | protocol.Ack
              | protocol.Error | protocol.ReloadReply) -> None:
        self.send(identity, protocol.encode(message))

    def send(self, identity: bytes, frame: bytes) -> None:
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.zap.close()
        with contextlib.suppress(OSError):
            os.unlink(self.endpoint.removeprefix("ipc://"))
