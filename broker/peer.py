"""The client side of the broker: one DEALER named after the actor.

A loop that polls `peer.socket` itself calls `peer.tick()` at least once per
interval and re-reads `peer.socket` when `peer.reconnects` changes.
A refused handshake raises AuthRefusedError, never a retry loop.
See docs/broker.md ("Reconnecting (Paranoid Pirate)", "Requests, retries,
timeouts").
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from dataclasses import dataclass

import structlog
import zmq

from broker import auth, protocol, ratelimit
from broker.curve import CurveClient, apply_client
from broker.errors import ProtocolError, RemoteError, RequestTimeoutError, StateDirError
from broker.heartbeat import HeartbeatRule, Liveness
from broker.requester import HandshakeWatch
from broker.statedir import StateDir, check_actor_name

BROKER_NAME = "broker"
_BROKER = BROKER_NAME.encode()
_DONE_IDS_MAX = 1024  # msg_ids of finished requests, so late replies can be dropped
# broker refusals that may clear up by themselves: the request backs off and resends
_TRANSIENT = frozenset({protocol.ErrorCode.UNKNOWN_RECIPIENT, protocol.ErrorCode.RECIPIENT_BUSY})

log = structlog.get_logger("broker.peer")

Received = tuple[str, protocol.Message]


@dataclass(frozen=True)
class PeerStats:
    sent_total: int
    received_total: int
    rejected_total: int
    retries_total: int
    reconnects: int
    inbox: int


class BrokerPeer:
    """One actor's connection to the broker."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        target: StateDir | str,
        name: str,
        heartbeat_interval_s: float = 1.0,
        heartbeat_misses: int = 3,
        *,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        curve: CurveClient | None = None,
        credential: auth.Credential | None = None,
    ) -> None:
        """`credential` (PLAIN) defaults to this process's own (broker/auth.py);
        the broker takes `name` only from the actor it authenticates as `name`."""
        if check_actor_name(name) == BROKER_NAME:
            raise StateDirError("the actor name 'broker' is reserved for the broker")
        self.name = name
        self.endpoint = target.endpoint("broker") if isinstance(target, StateDir) else target
        self.limits = limits
        self.rule = HeartbeatRule(heartbeat_interval_s, heartbeat_misses)
        self.reconnects = 0
        self._ctx = ctx
        self._curve = curve
        if curve is None and credential is None:
            credential = auth.default_credential(self.endpoint)
        if credential is not None and credential.name not in (name, auth.OPERATOR):
            raise auth.AuthError(f"the credential of {credential.name} cannot be {name}")
        self._credential = credential
        self._identity = name.encode()
        self._pid = os.getpid()
        self._inbox: deque[Received] = deque()
        self._done_ids: deque[str] = deque()
        self._done_set: set[str] = set()
        self._sent = 0
        self._received = 0
        self._rejected = 0
        self._retries = 0
        self._limiter = ratelimit.LogLimiter(log.warning)
        self._beat_frame = protocol.encode(protocol.Heartbeat(actor=name, pid=self._pid))
        self._idle_frame = protocol.encode(
            protocol.Heartbeat(actor=name, pid=self._pid, values={"idle": 1}))
        self._quiet = False  # hush(): idle, no heartbeats either way
        self._live = Liveness(self.rule, last_heard=time.monotonic())
        self._watch: HandshakeWatch | None = None
        self._sock = self._open()

    # --- socket -----------------------------------------------------------------
    def _open(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._credential is None or self._credential.name == auth.OPERATOR:
            sock.setsockopt(zmq.IDENTITY, self._identity)
        # else the broker names us by our credential and picks the routing id itself,
        # so no connection claiming our name can take our routing id
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        if self._curve is not None:
            apply_client(sock, self._curve)
        elif self._credential is not None:
            auth.apply_client(sock, self._credential)
        self._watch = HandshakeWatch(sock, self._watch)
        sock.connect(self.endpoint)
        with contextlib.suppress(zmq.Again):  # register at once: routable from now on
            sock.send_multipart([_BROKER, self._beat_frame], zmq.NOBLOCK)
        return sock

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The current DEALER, for a caller's own zmq.Poller (replaced on reconnect)."""
        return self._sock

    def reconnect(self) -> None:
        """Close and reopen the socket: queued frames in both directions are lost."""
        if self._watch is not None:
            self._watch.close()
        self._sock.close(linger=0)
        self._sock = self._open()
        self.reconnects += 1
        self._live.reset(time.monotonic())

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._sock.close(linger=0)

    # --- heartbeats -------------------------------------------------------------
    def hush(self) -> None:
        """Idle: tell the broker (one heartbeat marked `idle`), which then
        neither beats to this peer nor expires it; this side sends no beats
        and judges nothing from the silence. The connection itself carries
        liveness meanwhile: libzmq reconnects to a restarted broker, and
        `tick` says `idle` again on the new connection (docs/broker.md,
        "Idle peers"). Any other frame sent ends the quiet at the broker;
        call again after it, or `wake()` to beat again."""
        self._quiet = True
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart([_BROKER, self._idle_frame], zmq.NOBLOCK)

    def wake(self) -> None:
        """End `hush`: beat at once, a full expiry window from now."""
        self._quiet = False
        self._live.reset(time.monotonic())
        self.tick()

    @property
    def monitor(self) -> zmq.Socket[bytes] | None:
        """The socket that reports this peer's handshakes (for an idle poller)."""
        return self._watch.monitor if self._watch is not None else None

    def tick(self) -> None:
        """Send a heartbeat when due; reconnect when the broker went silent."""
        if self._quiet:
            if self._watch is not None and self._watch.reconnected(self.endpoint):
                self.hush()  # a new connection: the broker knows nothing of us
            return
        now = time.monotonic()
        # frames waiting in our own queue prove the broker was alive: read them first
        if self._live.dead(now) and not self._sock.poll(0, zmq.POLLIN):
            silent_s = now - self._live.last_heard
            if self._watch is not None:  # refused, not silent: AuthRefusedError
                self._watch.check(self.endpoint)
            self.reconnect()
            log.warning(
                "broker_reconnected",
                peer=self.name,
                silent_s=round(silent_s, 3),
                reconnects=self.reconnects,
            )
        if self._live.beat_due(now):
            # a full outbound queue means the broker is away: the liveness rule handles it
            with contextlib.suppress(zmq.Again):
                self._sock.send_multipart([_BROKER, self._beat_frame], zmq.NOBLOCK)

    # --- sending ----------------------------------------------------------------
    def send(self, to: str, message: protocol.Message, timeout_s: float = 5.0) -> None:
        """Send `message` to the actor `to`; RequestTimeoutError if the outbound
        queue stays full for `timeout_s` (the broker is down for long)."""
        self.send_frame(to, protocol.encode(message), timeout_s)

    def send_frame(self, to: str, frame: bytes, timeout_s: float = 5.0) -> None:
        """Send an already encoded protocol frame."""
        parts = [to.encode(), frame]
        try:
            self._sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.Again:
            deadline = time.monotonic() + timeout_s
            while True:
                self.tick()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeoutError(
                        f"{self.name}: cannot send to {to!r}: outbound queue full "
                        f"for {timeout_s}s (broker unreachable?)"
                    ) from None
                if self._sock.poll(self._wait_ms(deadline), zmq.POLLOUT):
                    try:
                        self._sock.send_multipart(parts, zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        continue
        self._sent += 1

    # --- receiving --------------------------------------------------------------
    def poll(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until `recv(0)` would return a message."""
        deadline = time.monotonic() + timeout_s
        while not self._inbox:
            item = self._next(deadline)
            if item is None:
                return False
            self._inbox.append(item)
        return True

    def recv(self, timeout_s: float) -> Received | None:
        """The next (sender, message), or None after `timeout_s`. Heartbeats are
        consumed here; an undecodable frame is logged, answered with an `error`
        and skipped."""
        if self._inbox:
            return self._inbox.popleft()
        return self._next(time.monotonic() + timeout_s)

    def request(
        self,
        to: str,
        message: protocol.Message,
        timeout_s: float = 5.0,
        retries: int = 3,
        resend_s: float | None = None,
    ) -> protocol.Message:
        """Send a request and return the reply with its msg_id.

        Each attempt waits `timeout_s`; a retry resends the same frame. A
        transient refusal by the broker (recipient unknown or busy: it may be
        reconnecting) waits one heartbeat interval and uses up a retry. Raises
        RemoteError for an `error` reply (or when transient refusals outlast
        the retries), RequestTimeoutError when the last attempt got no reply,
        AuthRefusedError when the broker refused the handshake.

        `resend_s`: within an attempt, the same frame is sent again every
        `resend_s` until the reply comes (for a request whose reply may take
        long, such as a foreground command's, to a recipient that answers a
        resend under the same msg_id once: a reply lost on the way, say while
        the broker restarted, then costs `resend_s`, not the whole attempt)."""
        msg_id = getattr(message, "msg_id", None)
        if not isinstance(msg_id, str):
            raise TypeError(f"a request needs a msg_id; {message.kind!r} has none")
        frame = protocol.encode(message)
        refusal: protocol.Error | None = None
        try:
            for attempt in range(retries + 1):
                if attempt:
                    self._retries += 1
                    log.info(
                        "request_retried",
                        peer=self.name,
                        to=to,
                        msg_id=msg_id,
                        attempt=attempt,
                        after=refusal.code.value if refusal else "timeout",
                    )
                reply = self._attempt(to, msg_id, frame, timeout_s, resend_s)
                if reply is None:
                    refusal = None
                    if self._watch is not None:  # unanswered: refused, or only slow?
                        self._watch.check(self.endpoint)
                    continue
                if isinstance(reply, protocol.Error):
                    if reply.code in _TRANSIENT and attempt < retries:
                        refusal = reply
                        self._pause(min(self.rule.interval_s, timeout_s))
                        continue
                    raise RemoteError(reply.code.value, reply.detail)
                return reply
        finally:
            self._finished(msg_id)
        raise RequestTimeoutError(
            f"{self.name}: no reply from {to!r} to {message.kind} {msg_id} "
            f"after {retries + 1} attempts of {timeout_s}s"
        )

    # --- internals --------------------------------------------------------------
    def _attempt(
        self, to: str, msg_id: str, frame: bytes, timeout_s: float,
        resend_s: float | None = None,
    ) -> protocol.Message | None:
        """Send `frame` and wait for its reply until the attempt's deadline. A
        reconnect loses whatever was queued, so the frame is sent again at once;
        with `resend_s`, it is also sent again every `resend_s` (see `request`)."""
        deadline = time.monotonic() + timeout_s
        self.tick()  # reconnect first if due, so the frame leaves on the live socket
        while True:
            self.send_frame(to, frame, timeout_s)
            generation = self.reconnects
            until = deadline if resend_s is None else min(deadline, time.monotonic() + resend_s)
            while (item := self._next(until, generation)) is not None:
                sender, reply = item
                # a reply from another host comes from HOST:TO (the fleet's bridge)
                if getattr(reply, "msg_id", None) == msg_id and (
                        sender in (to, BROKER_NAME) or sender.endswith(f":{to}")):
                    return reply
                self._inbox.append(item)
            if time.monotonic() >= deadline:
                return None
            if self.reconnects == generation:
                if until >= deadline:
                    return None
                log.debug("request_resent", peer=self.name, to=to, msg_id=msg_id,
                          reason="no reply yet")
                continue
            log.info(
                "request_resent", peer=self.name, to=to, msg_id=msg_id, reconnects=self.reconnects
            )

    def _pause(self, seconds: float) -> None:
        """Wait without losing traffic: messages that arrive go to the inbox."""
        deadline = time.monotonic() + seconds
        while (item := self._next(deadline)) is not None:
            self._inbox.append(item)

    def _finished(self, msg_id: str) -> None:
        if msg_id in self._done_set:
            return
        self._done_ids.append(msg_id)
        self._done_set.add(msg_id)
        if len(self._done_ids) > _DONE_IDS_MAX:
            self._done_set.discard(self._done_ids.popleft())

    def _wait_ms(self, deadline: float) -> int:
        until = min(deadline, self._live.next_deadline())
        return max(0, math.ceil((until - time.monotonic()) * 1000))

    def _next(self, deadline: float, generation: int | None = None) -> Received | None:
        """Read frames until one is an application message or the deadline passes
        (or, given the socket `generation`, until the socket is replaced)."""
        while True:
            self.tick()
            if generation is not None and self.reconnects != generation:
                return None
            if self._sock.poll(self._wait_ms(deadline), zmq.POLLIN):
                item = self._read()
                if item is not None:
                    return item
            elif time.monotonic() >= deadline:
                return None

    def _read(self) -> Received | None:
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        self._live.heard(time.monotonic())
        if len(frames) != 2:
            self._reject(None, None, f"expected 2 frames [from, body], got {len(frames)}")
            return None
        sender, body = frames
        try:
            message = protocol.decode(body, self.limits)
        except ProtocolError as exc:
            self._reject(sender, body, exc.detail, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - last line of defence: decode must not kill us
            failure = ProtocolError(
                protocol.ErrorCode.INTERNAL_ERROR, f"decode failed: {type(exc).__name__}"
            )
            self._reject(sender, body, failure.detail, failure)
            return None
        if sender == _BROKER and isinstance(message, protocol.Heartbeat):
            return None
        msg_id = getattr(message, "msg_id", None)
        if msg_id is not None and msg_id in self._done_set:
            return None  # a late or duplicate reply to a finished request
        self._received += 1
        return sender.decode("ascii", "replace"), message

    def _reject(
        self,
        sender: bytes | None,
        body: bytes | None,
        detail: str,
        exc: ProtocolError | None = None,
    ) -> None:
        self._rejected += 1
        peeked = (
            protocol.peek(body, self.limits) if body is not None else protocol.Peeked(None, None)
        )
        msg_id = (exc.msg_id if exc is not None else None) or peeked.msg_id
        if self._limiter.allow():
            log.warning(
                "frame_rejected",
                peer=self.name,
                sender=sender[:80].decode("ascii", "replace") if sender is not None else None,
                code=exc.code if exc is not None else protocol.ErrorCode.MALFORMED_FRAME.value,
                detail=detail[:200],
                msg_id=msg_id,
            )
        if exc is None or sender is None or sender == _BROKER or peeked.is_reply:
            return  # never answer the broker, nor an error or any reply (no loops)
        with contextlib.suppress(zmq.ZMQError):  # the sender will time out instead
            self._sock.send_multipart([sender, protocol.error_frame(exc, msg_id)], zmq.NOBLOCK)

    def statistics(self) -> PeerStats:
        return PeerStats(
            sent_total=self._sent,
            received_total=self._received,
            rejected_total=self._rejected,
            retries_total=self._retries,
            reconnects=self.reconnects,
            inbox=len(self._inbox),
        )
