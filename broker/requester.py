"""Reliable request/reply over a DEALER to a ROUTER: the Lazy Pirate pattern.

The same frame is resent on timeout; a refused handshake raises
AuthRefusedError. See docs/broker.md ("Requests, retries, timeouts") and
docs/protocol.md ("Authentication").
"""

from __future__ import annotations

import itertools
import os
import struct
import time

import zmq

from broker import appendwire, auth, protocol
from broker.curve import CurveClient, apply_client
from broker.errors import AuthRefusedError, ProtocolError, RemoteError, RequestTimeoutError

_counter = itertools.count(1)
_stamp = ""  # "<pid>.<start>.": this process's, made again in a forked child
_NOBLOCK = zmq.NOBLOCK
_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
# A refusal with no status (a mechanism the server does not speak, e.g. no
# credential at a PLAIN server) looks like a connection dropped mid-handshake
# (a server restarting): refused only after this many in a row.
NO_DETAIL_REFUSALS = 3


class HandshakeWatch:
    """A socket's monitor, read only when the caller went unanswered: `check`
    raises AuthRefusedError on a HANDSHAKE_FAILED_AUTH, or on NO_DETAIL_REFUSALS
    other handshake failures in a row (counted across the sockets a client
    opens one after the other: pass the previous watch)."""

    def __init__(self, sock: zmq.Socket[bytes], previous: HandshakeWatch | None = None) -> None:
        self._sock = sock
        self._monitor: zmq.Socket[bytes] | None = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self._failed: int = previous._failed if previous is not None else 0

    def check(self, endpoint: str) -> None:
        self.reconnected(endpoint)

    @property
    def monitor(self) -> zmq.Socket[bytes] | None:
        """The monitor socket, for a caller's poller (None once closed)."""
        return self._monitor

    def reconnected(self, endpoint: str) -> bool:
        """Read the events waiting: True when a handshake succeeded since the
        last read (the connection was made again, e.g. to a restarted
        broker); AuthRefusedError as `check`."""
        monitor = self._monitor
        if monitor is None:
            return False
        succeeded = False
        while monitor.poll(0, zmq.POLLIN):
            frames = monitor.recv_multipart(_NOBLOCK)
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            kind, value = struct.unpack("=hi", frames[0])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failed = 0
                succeeded = True
                continue
            self._failed += 1
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH or self._failed >= NO_DETAIL_REFUSALS:
                name = (zmq.Event(kind).name or str(kind)).removeprefix("EVENT_")
                raise AuthRefusedError(endpoint, name, value)
        return succeeded

    def close(self) -> None:
        """Before the socket closes."""
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None


def _restamp() -> None:
    global _stamp  # noqa: PLW0603
    _stamp = f"{os.getpid():x}.{time.monotonic_ns():x}."


_restamp()
os.register_at_fork(after_in_child=_restamp)


def new_msg_id(prefix: str = "m") -> str:
    """A msg_id unique within this process lifetime (a counter) and across
    restarts (the pid and the monotonic clock when the process started or
    forked). Made per request on the append path: no system call (getpid is
    one), no clock read."""
    return f"{prefix}{_stamp}{next(_counter):x}"


class Requester:
    """One outstanding request at a time, reconnecting after a timeout."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        *,
        identity: bytes | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        curve: CurveClient | None = None,
        credential: auth.Credential | None = None,
        reconnect_ivl_ms: int | None = None,
    ) -> None:
        """`credential` authenticates with PLAIN (broker/auth.py; default: this
        process's own, for an ipc:// endpoint); `curve` with CURVE (tcp://).
        `reconnect_ivl_ms`: how soon a failed connection is tried again (ZeroMQ's
        default, 100 ms, when None): a waiter for a restarting server sets it low."""
        self._ctx = ctx
        self._reconnect_ivl_ms = reconnect_ivl_ms
        if curve is None and credential is None:
            credential = auth.default_credential(endpoint)
        self._credential = credential
        self.endpoint = endpoint
        self._identity = identity
        self._curve = curve
        self._limits = limits
        self.reconnects = 0
        self._rcvtimeo_ms = -1
        self._watch: HandshakeWatch | None = None
        self._sock = self._open()

    def _open(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._limits.max_frame_bytes)
        if self._reconnect_ivl_ms is not None:
            sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ivl_ms)
        if self._identity is not None:
            sock.setsockopt(zmq.IDENTITY, self._identity)
        if self._curve is not None:
            apply_client(sock, self._curve)
        elif self._credential is not None:
            auth.apply_client(sock, self._credential)
        self._watch = HandshakeWatch(sock, self._watch)
        sock.connect(self.endpoint)
        self._rcvtimeo_ms = -1  # a new socket waits forever until told otherwise
        return sock

    def _close_socket(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._sock.close(linger=0)

    def _reopen(self) -> None:
        self._close_socket()
        self._sock = self._open()
        self.reconnects += 1

    def _check_refused(self) -> None:
        """Raise AuthRefusedError when the server refused our handshake since
        the socket was opened (called only after an attempt went unanswered,
        so it costs the hot path nothing)."""
        if self._watch is not None:
            self._watch.check(self.endpoint)

    def request(
        self,
        message: protocol.Ping
        | protocol.Append
        | protocol.AppendMany
        | protocol.ReadStream
        | protocol.StatsRequest
        | protocol.StatusRequest
        | protocol.SignalRequest
        | protocol.RestartRequest
        | protocol.StopRequest
        | protocol.StartRequest
        | protocol.RemoveRequest
        | protocol.ReloadRequest
        | protocol.SpawnRequest,
        *,
        timeout_s: float = 5.0,
        retries: int = 3,
    ) -> protocol.Message:
        """Send `message` and return the reply with its msg_id.

        Raises RemoteError for an `error` reply, RequestTimeoutError when no
        reply came after `retries` resends."""
        reply = self._exchange(protocol.encode(message), message.msg_id, message.kind,
                               timeout_s, retries, fast=False)
        assert not isinstance(reply, appendwire.AppendOkFrame | appendwire.AppendManyOkFrame)
        return reply

    def request_append(
        self, frame: bytes, msg_id: str, kind: str, *, timeout_s: float = 5.0, retries: int = 3
    ) -> protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame:
        """`request` for an append or append_many already encoded
        (appendwire.encode_append*): its ack is decoded in C when it can be
        (broker/appendwire.py), else by protocol.decode.

        The common case takes one short path (docs/decisions.md, "The
        append path's frames in msgspec"): the socket takes the frame at once and the first
        frame back is this request's ack. Anything else (a full pipe, a
        timeout, a late or garbled reply, an error) goes on exactly as
        `request`: the rest of the first attempt's wait, then the resends."""
        sock = self._sock
        if (len(frame) <= self._limits.max_frame_bytes
                and self._rcvtimeo_ms == int(timeout_s * 1000)):
            started = time.monotonic()
            try:
                sock.send(frame, _NOBLOCK)
            except zmq.Again:
                pass  # not sent: the general path sends it
            else:
                try:
                    answer = sock.recv()
                except zmq.Again:  # the first attempt timed out unanswered
                    return self._exchange(frame, msg_id, kind, timeout_s, retries,
                                          fast=True, first_attempt=1)
                ack = appendwire.decode_reply(answer, self._limits)
                if ack is not None and ack.msg_id == msg_id:
                    return ack
                reply = self._reply(answer, msg_id, ack)
                if reply is None:  # not this request's: wait out the first attempt
                    left_s = timeout_s - (time.monotonic() - started)
                    reply = self._await(msg_id, left_s, fast=True) if left_s > 0 else None
                if reply is not None:
                    return self._answered(reply)
                return self._exchange(frame, msg_id, kind, timeout_s, retries,
                                      fast=True, first_attempt=1)
        return self._exchange(frame, msg_id, kind, timeout_s, retries, fast=True)

    def _exchange(
        self, frame: bytes, msg_id: str, kind: str, timeout_s: float, retries: int, *,
        fast: bool, first_attempt: int = 0,
    ) -> protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame:
        """Attempts `first_attempt`..`retries` (each after the first on a new socket)."""
        if len(frame) > self._limits.max_frame_bytes:
            raise ProtocolError(
                protocol.ErrorCode.FRAME_TOO_LARGE,
                f"{kind} of {len(frame)} bytes > limit {self._limits.max_frame_bytes}",
            )
        for attempt in range(first_attempt, retries + 1):
            if attempt:
                self._check_refused()
                self._reopen()
            if not self._send(frame, timeout_s):
                continue  # no connection took the frame within the deadline: retry
            reply = self._await(msg_id, timeout_s, fast)
            if reply is not None:
                return self._answered(reply)
        self._check_refused()
        raise RequestTimeoutError(
            f"no reply from {self.endpoint} to {kind} {msg_id} "
            f"after {retries + 1} attempts of {timeout_s}s"
        )

    @staticmethod
    def _answered(
        reply: protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame,
    ) -> protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame:
        """The reply to return; an `error` reply raised as RemoteError."""
        if isinstance(reply, protocol.Error):
            raise RemoteError(reply.code.value, reply.detail)
        return reply

    def _reply(
        self, frame: bytes, msg_id: str,
        fast_reply: appendwire.AppendOkFrame | appendwire.AppendManyOkFrame | None,
    ) -> protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame | None:
        """`frame` decoded (`fast_reply`: as appendwire decoded it, if it did)
        when it answers `msg_id`; None when it is garbled or another's."""
        reply: protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame
        if fast_reply is not None:
            reply = fast_reply
        else:
            try:
                reply = protocol.decode(frame, self._limits)
            except ProtocolError:  # a garbled reply is as good as none: keep waiting
                return None
        return reply if getattr(reply, "msg_id", None) == msg_id else None

    def _send(self, frame: bytes, timeout_s: float) -> bool:
        """Send without ever blocking past the deadline (a DEALER with no live
        connection, e.g. during a refused CURVE handshake, would block)."""
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            if not self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
                return False
            try:
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True

    def _await(
        self, msg_id: str, timeout_s: float, fast: bool = False
    ) -> protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame | None:
        """The reply carrying `msg_id`, or None after `timeout_s`. A blocking
        receive with a receive timeout (RCVTIMEO, set only when it changes), not
        a poll and a receive: pyzmq's `Socket.poll` builds a Poller per call,
        which cost as much CPU as the rest of a small append's round trip."""
        deadline = time.monotonic() + timeout_s
        sock = self._sock
        remaining_ms = int(timeout_s * 1000)  # the same every request: no setsockopt
        while True:
            if remaining_ms <= 0:
                return None
            if remaining_ms != self._rcvtimeo_ms:
                sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
                self._rcvtimeo_ms = remaining_ms
            try:
                frame = sock.recv()
            except zmq.Again:
                return None
            fast_reply = appendwire.decode_reply(frame, self._limits) if fast else None
            reply = self._reply(frame, msg_id, fast_reply)
            if reply is not None:
                return reply
            # garbled, or a late reply to an earlier request: drop it
            remaining_ms = int((deadline - time.monotonic()) * 1000)

    def close(self) -> None:
        self._close_socket()
