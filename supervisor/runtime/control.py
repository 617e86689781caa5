"""The supervisor's control socket: a ROUTER at run/supervisor.sock.

See docs/protocol.md ("Supervision (`run/supervisor.sock`)",
"Authentication").
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import structlog
import zmq

from broker import auth, protocol, ratelimit
from broker.errors import ProtocolError
from broker.statedir import StateDir, bind_umask

log = structlog.get_logger("supervisor.control")
MAX_PER_TURN = 2000  # frames handled per loop turn, so timers still run under load
SNDHWM = 16  # replies queued for one client (the CLI asks one thing at a time)
RCVHWM = 1000  # frames queued from one peer (a child beats once a second)
_NOTICES = frozenset({"ready", "heartbeat"})


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
        # up to twice the limit a frame gets a typed frame_too_large reply; beyond
        # that the transport drops the connection
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * protocol.DEFAULT_LIMITS.max_frame_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises: counted, dropped
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.zap = auth.ZapHandler(ctx, auth.ensure_keys(state_dir))
        auth.apply_server(self.sock)
        old = bind_umask()
        try:
            self.sock.bind(self.endpoint)
        finally:
            os.umask(old)
        self.rejected_total = 0
        self.dropped_total = 0  # replies not delivered, unsolicited replies not answered
        self.failures_total = 0
        self._limiter = ratelimit.LogLimiter(log.warning)
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
            try:
                incoming = self._accept(frames, auth.user_of(head))
            except Exception:  # the last line of defence: log, go on
                self.failures_total += 1
                if self._limiter.allow():
                    log.exception("frame_handling_failed", failures_total=self.failures_total)
                continue
            if incoming is not None and self._permitted(incoming):
                out.append(incoming)
        self._limiter.tick()
        return out

    def _accept(self, frames: list[bytes], user: str) -> Incoming | None:
        if len(frames) != 2:
            self._refuse(frames[0], frames[-1] if len(frames) > 1 else b"", ProtocolError(
                protocol.ErrorCode.MALFORMED_FRAME, f"{len(frames) - 1} frames, expected 1"))
            return None
        identity, frame = frames
        try:
            message = protocol.decode(frame)
        except ProtocolError as exc:
            self._refuse(identity, frame, exc)
            return None
        if protocol.is_reply(message) and message.kind not in _NOTICES:
            self.dropped_total += 1  # an unsolicited reply: never answered
            if self._limiter.allow():
                log.warning("reply_dropped", sender=identity[:64].hex(), kind=message.kind,
                            msg_id=getattr(message, "msg_id", None))
            return None
        return Incoming(identity, message, user)

    def _refuse(self, identity: bytes, frame: bytes, exc: ProtocolError) -> None:
        self.rejected_total += 1
        peeked = protocol.peek(frame)
        msg_id = exc.msg_id or peeked.msg_id
        if self._limiter.allow():
            log.warning("frame_rejected", sender=identity[:64].hex(), code=exc.code,
                        detail=exc.detail[:200], msg_id=msg_id)
        if not peeked.is_reply:  # never answer an error (or any reply) with an error
            self.send(identity, protocol.error_frame(exc, msg_id))

    def handling_failed(self, incoming: Incoming) -> None:
        """The runtime's handler raised on `incoming`: count it, log it (rate
        limited, with the traceback), and answer a request with internal_error."""
        self.failures_total += 1
        message = incoming.message
        if self._limiter.allow():
            log.exception("message_handling_failed", kind=message.kind,
                          failures_total=self.failures_total)
        msg_id = getattr(message, "msg_id", None)
        if not protocol.is_reply(message) and msg_id is not None:
            self.reply(incoming.identity, protocol.Error(
                msg_id=msg_id, code=protocol.ErrorCode.INTERNAL_ERROR,
                detail=f"the supervisor failed to handle {message.kind}"))

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
        if self._limiter.allow():
            log.warning("control_refused", user=user, kind=msg.kind, detail=refusal,
                        forbidden_total=self.forbidden_total)
        if not isinstance(msg, protocol.Ready | protocol.Heartbeat):  # those expect no reply
            self.reply(incoming.identity, protocol.Error(
                msg_id=getattr(msg, "msg_id", None), code=protocol.ErrorCode.FORBIDDEN,
                detail=refusal))
        return False

    def values(self) -> dict[str, int | float]:
        """The control socket's counters (a `stats` reply)."""
        return {"rejected_total": self.rejected_total, "dropped_total": self.dropped_total,
                "failures_total": self.failures_total, "forbidden_total": self.forbidden_total}

    def reply(self, identity: bytes, message: protocol.StatusReply | protocol.Ack
              | protocol.Error | protocol.ReloadReply | protocol.Pong
              | protocol.Stats) -> None:
        self.send(identity, protocol.encode(message))

    def send(self, identity: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # gone (EHOSTUNREACH) or not reading (EAGAIN)
            self.dropped_total += 1
            if self._limiter.allow():
                log.warning("reply_dropped", peer=identity[:64].hex(), errno=exc.errno)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.zap.close()
        with contextlib.suppress(OSError):
            os.unlink(self.endpoint.removeprefix("ipc://"))
