"""The client end of the writer's local lane: appends as SOCK_SEQPACKET packets.

An optimisation, never a second set of rules: when the lane cannot answer the
caller sends the same frame on the ROUTER. See docs/protocol.md ("The local
lane (`run/writer.lane`)").
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from pathlib import Path

from actors.writer.lane import HELLO_OK, MAX_PACKET, hello
from broker import appendwire, auth, protocol
from broker.errors import ProtocolError, RemoteError

ENV_LANE = "CORRAL_WRITER_LANE"
RETRY_AFTER_S = 1.0
Answer = protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame

_forks = 0  # this process's fork generation: a connection made before a fork is the parent's


def _forked() -> None:
    global _forks  # noqa: PLW0603
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def lane_enabled() -> bool:
    return os.environ.get(ENV_LANE, "1") != "0"


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


class LaneClient:
    """One connection to the writer's lane, one request at a time."""

    def __init__(self, path: Path, credential: auth.Credential,
                 limits: protocol.Limits = protocol.DEFAULT_LIMITS) -> None:
        self.path = path
        self._credential = credential
        self._limits = limits
        self._sock: socket.socket | None = None
        self._made_in = _forks  # the fork generation that made `_sock`
        self._timeout_s = -1.0  # SO_RCVTIMEO/SO_SNDTIMEO as last set
        self._idle_until = 0.0
        self.connects = 0
        self.fallbacks = 0  # requests handed back to the ROUTER

    def request_append(self, frame: bytes, msg_id: str, *,
                       timeout_s: float) -> Answer | None:
        """The answer to `frame` (an encoded append or append_many): an ack,
        or the reply protocol.decode makes of anything else that answers
        `msg_id`; an `error` reply raised as RemoteError. None when the lane
        cannot be used or did not answer within `timeout_s`: send it on the
        ROUTER."""
        if len(frame) > MAX_PACKET:
            return None
        sock = self._sock
        if sock is not None and self._made_in != _forks:
            self._drop()  # inherited through a fork: the parent's connection, not ours
            sock = None
        if sock is None:
            if time.monotonic() < self._idle_until:
                return None
            sock = self._connect(timeout_s)
            if sock is None:
                self._fall_back()
                return None
        elif self._timeout_s != timeout_s:
            self._set_timeout(sock, timeout_s)
        try:
            sock.send(frame)
            deadline = time.monotonic() + timeout_s
            while True:
                packet = sock.recv(MAX_PACKET)
                if not packet:
                    break  # the writer closed the connection (it stopped)
                answer = self._answer(packet, msg_id)
                if answer is not None:
                    return answer
                left_s = deadline - time.monotonic()  # another's reply: wait on
                if left_s <= 0:
                    break
                self._set_timeout(sock, left_s)
        except OSError:  # a timeout (EAGAIN) or a broken connection
            pass
        self._drop()
        self._fall_back()
        return None

    def _answer(self, packet: bytes, msg_id: str) -> Answer | None:
        ack = appendwire.decode_reply(packet, self._limits)
        if ack is not None:
            return ack if ack.msg_id == msg_id else None
        try:
            reply = protocol.decode(packet, self._limits)
        except ProtocolError:
            return None  # garbled: as good as none
        if getattr(reply, "msg_id", None) != msg_id:
            return None
        if isinstance(reply, protocol.Error):
            raise RemoteError(reply.code.value, reply.detail)
        return reply

    def _connect(self, timeout_s: float) -> socket.socket | None:
        """A connection that passed its hello, or None (no lane now). A refused
        credential is raised (RemoteError forbidden): the ROUTER would refuse
        it too."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._set_timeout(sock, timeout_s)
            sock.connect(str(self.path))
            sock.send(hello(self._credential))
            answer = sock.recv(MAX_PACKET)
        except OSError:
            sock.close()
            return None
        if answer == HELLO_OK:
            self._sock, self._made_in = sock, _forks
            self.connects += 1
            return sock
        sock.close()
        try:
            refusal = protocol.decode(answer, self._limits) if answer else None
        except ProtocolError:
            refusal = None
        if isinstance(refusal, protocol.Error) and refusal.code == protocol.ErrorCode.FORBIDDEN:
            raise RemoteError(refusal.code.value, refusal.detail)
        return None  # busy, closed, or not a lane we know

    def _set_timeout(self, sock: socket.socket, seconds: float) -> None:
        value = _timeval(max(seconds, 0.001))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout_s = seconds

    def _fall_back(self) -> None:
        """Count a request handed to the ROUTER; leave the lane alone a while."""
        self.fallbacks += 1
        self._idle_until = time.monotonic() + RETRY_AFTER_S

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._timeout_s = -1.0

    def close(self) -> None:
        self._drop()
