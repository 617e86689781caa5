"""The writer's transports (actors/writer/process.py): the ROUTER socket
(`run/writer.sock`, and any tcp:// endpoints with CURVE) and the local lane
(`run/writer.lane`, actors/writer/lane.py), both authenticated (broker/auth.py).
Frames come in as `(user, parts)`; acks, replies and refusals go out to the
connection they came from, never blocking: a reply that cannot be queued is
dropped and counted (the client's retry gets it again).
"""

from __future__ import annotations

import os
import resource
from typing import TYPE_CHECKING

import structlog
import zmq

from actors.writer.lane import LaneServer, lane_path
from broker import appendwire, auth, curve, protocol, ratelimit
from broker.curve import check_endpoints
from broker.durable import write_atomic
from broker.errors import ProtocolError
from broker.statedir import StateDir, bind_umask

if TYPE_CHECKING:
    from actors.writer.groupcommit import Ack, ManyAck

# Replies queued for one client that does not read them; more are dropped
# (counted in dropped_total, logged at a bounded rate). A client with a few
# requests in flight never comes near it.
SNDHWM = 32
RCVHWM = 1000  # requests queued from one client before ZeroMQ stops reading it
# pyzmq's flags and options as plain ints: an enum `|` per ack cost a Python call
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

Frames = list[tuple[str, list[bytes]]]  # (the sender's authenticated name, its frames)


class Transport:
    """The writer's sockets: what comes in, what goes out, what was dropped."""

    def __init__(self, state_dir: StateDir, *, curve_on: bool, tcp_endpoints: tuple[str, ...],
                 max_frame_bytes: int, lane_connections: int | None,
                 limits: protocol.Limits, limiter: ratelimit.LogLimiter) -> None:
        self.state_dir = state_dir
        self.curve = curve_on
        self.tcp_endpoints = tcp_endpoints
        self.max_frame_bytes = max_frame_bytes
        self.lane_connections = lane_connections
        self.limits = limits
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer")
        self._limiter = limiter
        self.zap: auth.ZapHandler | None = None
        self.lane: LaneServer | None = None
        self.dropped_total = 0  # replies not delivered (client gone or not reading)
        self.rejected_total = 0  # frames refused with an error

    def bind(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Bind run/writer.sock (and any tcp:// endpoints, CURVE only); the
        endpoints actually bound are written to run/writer.endpoints."""
        check_endpoints(self.tcp_endpoints, self.curve)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # The transport drops peers sending over twice the limit; frames between
        # the limit and that get a typed frame_too_large reply from decode().
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises: dropped, counted
        # every connection authenticates (broker/auth.py): PLAIN, or CURVE with --curve
        keyring = auth.ensure_keys(self.state_dir)
        if self.curve:
            server = curve.load_server(curve.keys_dir(self.state_dir.root))
            self.zap = auth.ZapHandler(ctx, keyring, server.authorized_dir)
            curve.apply_server(self.sock, server)
        else:
            self.zap = auth.ZapHandler(ctx, keyring)
            auth.apply_server(self.sock)
        endpoint = self.state_dir.endpoint("writer")
        old = bind_umask()
        try:
            path = endpoint.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)  # a stale socket file of a dead writer; we hold the lock
            if not self.curve and self.lane_connections != 0:
                self._bind_lane(keyring)  # (with CURVE every local client uses keys too)
            self.sock.bind(endpoint)
            bound = [endpoint]
            for extra in self.tcp_endpoints:
                self.sock.bind(extra)
                bound.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        finally:
            os.umask(old)
        self.endpoint = endpoint
        write_atomic(
            self.state_dir.run_dir / "writer.endpoints", ("\n".join(bound) + "\n").encode()
        )

    def _bind_lane(self, keyring: auth.Keyring) -> None:
        """The local lane beside the ROUTER; without it (a path too long for
        a Unix socket, say) clients use the ROUTER alone."""
        path = lane_path(self.state_dir.run_dir)
        try:
            cap = self.lane_connections or lane_capacity()
            self.lane = LaneServer(path, keyring, max_connections=cap)
        except OSError as exc:
            self.log.warning("lane_unavailable", path=str(path), error=str(exc))

    # --- in -------------------------------------------------------------------
    def receive(self, max_frames: int) -> Frames:
        """What waits on the ROUTER socket (up to `max_frames` frames)."""
        sock = self.sock
        frames: Frames = []
        while len(frames) < max_frames:
            try:  # the first frame carries the sender's authenticated name
                head = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            parts = [head.bytes]
            frame = head
            while frame.more:  # the frame says it (getsockopt built an enum per call)
                frame = sock.recv(copy=False)
                parts.append(frame.bytes)
            frames.append((auth.user_of(head), parts))
            if len(frames) == 1 and not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                break  # a lone request: asked, not found by a zmq.Again (an exception
                # built per turn, with its message, cost more than the rest of a turn);
                # past the first, the turn ends on one zmq.Again instead of asking
                # after every frame (2 us each: pyzmq makes an enum per getsockopt)
        return frames

    def receive_lane(self, max_frames: int) -> Frames:
        """`receive` for the lane's ready connections (its refusals answered here)."""
        assert self.lane is not None
        got = self.lane.receive(max_frames)
        for ident, exc in got.refusals:
            self.refuse(ident, exc, None)
        return got.frames

    # --- out ------------------------------------------------------------------
    def send_acks(self, acks: list[Ack]) -> None:
        # values are ours and known valid: encoded in C without a model, and sent
        # as two frames (what send_multipart does, without its per-part checks);
        # ROUTER_MANDATORY refuses at the first frame, so nothing half-sent stays.
        # A lane connection's ack is one packet, sent by the lane's acker.
        if not acks:
            return
        send = self.sock.send
        more = _NOBLOCK_SNDMORE
        encode = appendwire.encode_append_ok
        lane = self.lane
        on_lane: list[tuple[bytes, bytes]] = []
        for ident, msg_id, seq, duplicate in acks:
            frame = encode(msg_id, seq, duplicate)
            if lane is not None and lane.owns(ident):
                on_lane.append((ident, frame))
                continue
            try:
                send(ident, more)
                send(frame, _NOBLOCK)
            except zmq.ZMQError as exc:
                self.dropped(ident, _reason(exc), exc.errno)
        if on_lane:
            assert lane is not None
            lane.send_acks(on_lane)

    def send_many_acks(self, acks: list[ManyAck]) -> None:
        if not acks:
            return
        send = self.sock.send
        more = _NOBLOCK_SNDMORE
        encode = appendwire.encode_append_many_ok
        lane = self.lane
        on_lane: list[tuple[bytes, bytes]] = []
        for ident, msg_id, first, count, prev, duplicate in acks:
            frame = encode(msg_id, first, count, prev, duplicate)
            if lane is not None and lane.owns(ident):
                on_lane.append((ident, frame))
                continue
            try:
                send(ident, more)
                send(frame, _NOBLOCK)
            except zmq.ZMQError as exc:
                self.dropped(ident, _reason(exc), exc.errno)
        if on_lane:
            assert lane is not None
            lane.send_acks(on_lane)

    def reply(
        self,
        ident: bytes,
        message: protocol.Records | protocol.Error | protocol.Pong | protocol.Stats,
    ) -> None:
        self.send(ident, protocol.encode(message))

    def refuse(
        self, ident: bytes, exc: ProtocolError, msg_id: str | None, frame: bytes | None = None
    ) -> None:
        """Answer a refused frame with an `error`, unless the frame is itself a
        reply (an error is never answered with an error)."""
        self.rejected_total += 1
        peeked = protocol.peek(frame, self.limits) if frame is not None else None
        if msg_id is None and peeked is not None:
            msg_id = peeked.msg_id
        if self._limiter.allow():
            self.log.warning(
                "frame_rejected", code=exc.code, detail=exc.detail[:200], msg_id=msg_id
            )
        if peeked is not None and peeked.is_reply:
            self.dropped_total += 1
            return
        self.send(ident, protocol.error_frame(exc, msg_id))

    def send(self, ident: bytes, frame: bytes) -> None:
        if self.lane is not None:
            sent = self.lane.send(ident, frame)
            if sent == "too_large":  # a reply (a page of records) no packet holds
                sent = self.lane.send(ident, protocol.error_frame(ProtocolError(
                    protocol.ErrorCode.FRAME_TOO_LARGE,
                    "the reply is larger than a lane packet: ask on the ROUTER"),
                    protocol.peek(frame, self.limits).msg_id))
            if sent is not None:
                if sent != "sent":
                    self.dropped(ident, sent)
                return
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.dropped(ident, _reason(exc), exc.errno)

    def dropped(self, ident: bytes, reason: str, errno: int | None = None) -> None:
        """A reply could not be queued: the client is gone (EHOSTUNREACH, a
        closed lane connection) or does not read (EAGAIN: SNDHWM replies wait
        already; a lane socket's buffer is full). It is dropped; the client's
        retry (same msg_id, same key) gets it again."""
        self.dropped_total += 1
        if self._limiter.allow():
            self.log.warning(
                "reply_dropped",
                peer=ident[:64].hex(),
                errno=errno,
                reason=reason,
                dropped_total=self.dropped_total,
            )

    def values(self) -> dict[str, int | float]:
        return self.lane.values() if self.lane is not None else {}

    def tick(self, now: float) -> None:
        if self.lane is not None:
            self.lane.tick(now)

    def close(self) -> None:
        if self.zap is not None:
            self.zap.close()
        if self.lane is not None:
            self.lane.close()


def _reason(exc: zmq.ZMQError) -> str:
    return "not_reading" if exc.errno == zmq.EAGAIN else "gone"


def lane_capacity() -> int:
    """How many lane connections the writer holds: half its fd limit (the rest
    for segments, ZeroMQ's sockets and the ROUTER's peers), at most 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 2))
