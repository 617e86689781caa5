"""The writer's local append lane: `run/writer.lane`, served from its own loop.

The same frames and rules as the ROUTER. See docs/protocol.md ("The local
lane (`run/writer.lane`)") and docs/decisions.md ("A local append lane
beside the writer's ROUTER").
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import select
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from actors.writer.laneacker import Frames, LaneAcker
from broker import auth, protocol
from broker.errors import ProtocolError

HELLO_PREFIX = b"corral-lane/1\n"
HELLO_OK = b"corral-lane/1 ok"
HELLO_TIMEOUT_S = 5.0
MAX_PACKET = 64 * 1024  # under the default SO_SNDBUF's message bound (~208 KiB)
MAX_HELLO = 512
PACKETS_PER_CONNECTION = 64  # read from one connection in a turn, at most (fairness)
ACCEPTS_PER_TURN = 256  # a flood of connects cannot hold the loop either
DEFAULT_MAX_CONNECTIONS = 4096
ACCEPT_PAUSE_S = 0.1  # after EMFILE: stop accepting this long (no busy loop)
_IDENT_PREFIX = b"\x00L"  # 10 bytes: never a ROUTER identity (5 bytes, or no leading 0)
_DONTWAIT = int(socket.MSG_DONTWAIT)  # plain ints: an IntFlag's `&` is a Python call
_TRUNC = int(socket.MSG_TRUNC)


def lane_path(run_dir: Path) -> Path:
    return run_dir / "writer.lane"


def hello(credential: auth.Credential) -> bytes:
    return HELLO_PREFIX + credential.name.encode() + b"\n" + credential.secret


@dataclass(slots=True)
class Connection:
    sock: socket.socket
    ident: bytes
    opened_at: float
    user: str | None = None


@dataclass(slots=True)
class LaneCounters:
    accepted_total: int = 0
    refused_total: int = 0  # hellos refused, truncated packets, connections over the cap
    closed_total: int = 0
    hello_timeouts_total: int = 0


@dataclass(slots=True)
class Received:
    """What a turn of `receive` took: authenticated frames as the writer's
    `_handle` takes them (user, [ident, frame]), and typed refusals to answer."""

    frames: list[tuple[str, list[bytes]]] = field(default_factory=list)
    refusals: list[tuple[bytes, ProtocolError]] = field(default_factory=list)


class LaneServer:
    """The listening socket and its connections, polled through one epoll fd."""

    def __init__(self, path: Path, keyring: auth.Keyring, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        """Bind `path` (a stale socket file of a dead writer is replaced: the
        caller holds the writer's lock). Raises OSError when it cannot bind
        (the caller runs without a lane)."""
        self.path = path
        self._keyring = keyring
        self.max_connections = max_connections
        self.counters = LaneCounters()
        self._ids = itertools.count(1)
        self._by_fd: dict[int, Connection] = {}
        self._by_ident: dict[bytes, Connection] = {}
        self._pending: dict[int, Connection] = {}  # no hello yet
        self._buf = bytearray(MAX_PACKET)
        self._view = memoryview(self._buf)
        self._accept_paused_until = 0.0
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(path))
            listener.listen(512)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._epoll = select.epoll()
        self._epoll.register(listener.fileno(), select.EPOLLIN)
        self._acker = LaneAcker(self._socket_of)

    def fileno(self) -> int:
        return self._epoll.fileno()

    def owns(self, ident: bytes) -> bool:
        return ident in self._by_ident

    # --- receiving --------------------------------------------------------------
    def receive(self, max_frames: int) -> Received:
        """Accept what waits and read the ready connections' packets (at most
        `max_frames` frames, `PACKETS_PER_CONNECTION` from any one)."""
        got = Received()
        listener_fd = self._listener.fileno()
        for fd, _ in self._epoll.poll(0):
            if fd == listener_fd:
                self._accept()
                continue
            conn = self._by_fd.get(fd)
            if conn is not None:
                self._read(conn, got, max_frames)
            if len(got.frames) >= max_frames:
                break
        return got

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting()
                return
            self.counters.accepted_total += 1
            if len(self._by_fd) >= self.max_connections:
                self.counters.refused_total += 1
                self._answer_and_close(sock, ProtocolError(
                    protocol.ErrorCode.RECIPIENT_BUSY,
                    f"the lane holds {self.max_connections} connections: use the ROUTER"))
                continue
            sock.setblocking(False)
            ident = _IDENT_PREFIX + next(self._ids).to_bytes(8, "big")
            conn = Connection(sock, ident, time.monotonic())
            self._by_fd[sock.fileno()] = conn
            self._by_ident[ident] = conn
            self._pending[sock.fileno()] = conn
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _pause_accepting(self) -> None:
        """Out of fds: the listener would stay readable and spin the loop, so it
        leaves the epoll set until `tick` puts it back."""
        with contextlib.suppress(OSError):
            self._epoll.unregister(self._listener.fileno())
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def _read(self, conn: Connection, got: Received, max_frames: int) -> None:
        sock, view = conn.sock, self._view
        for _ in range(PACKETS_PER_CONNECTION):
            try:
                size, _, flags, _ = sock.recvmsg_into([view], 0, _DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self._close(conn)
                return
            if size == 0:  # the peer closed (an empty packet is no frame either)
                self._close(conn)
                return
            if flags & _TRUNC:
                self.counters.refused_total += 1
                too_large = ProtocolError(
                    protocol.ErrorCode.FRAME_TOO_LARGE,
                    f"a lane packet holds {MAX_PACKET} bytes at most: send it on the ROUTER")
                if conn.user is None:  # no hello is that long: refused and closed
                    self._forget(conn)
                    self._answer_and_close(conn.sock, too_large)
                    return
                got.refusals.append((conn.ident, too_large))
                continue
            packet = bytes(view[:size])
            if conn.user is None:
                if not self._hello(conn, packet):
                    return
                continue
            got.frames.append((conn.user, [conn.ident, packet]))
            if len(got.frames) >= max_frames:
                return

    def _hello(self, conn: Connection, packet: bytes) -> bool:
        """Authenticate `conn` by its first packet; False when it was refused
        (and closed)."""
        name, password = b"", b""
        if packet.startswith(HELLO_PREFIX) and len(packet) <= MAX_HELLO:
            name, _, password = packet[len(HELLO_PREFIX):].partition(b"\n")
        try:
            user = name.decode("ascii")
        except UnicodeDecodeError:
            user = ""
        if not user or not self._keyring.verify(user, password):
            self.counters.refused_total += 1
            self._forget(conn)
            self._answer_and_close(conn.sock, ProtocolError(
                protocol.ErrorCode.FORBIDDEN, "lane hello refused: not a valid credential"))
            return False
        del self._pending[conn.sock.fileno()]
        conn.user = user
        if self.send(conn.ident, HELLO_OK) != "sent":
            self._close(conn)
            return False
        return True

    # --- sending ----------------------------------------------------------------
    def _socket_of(self, ident: bytes) -> socket.socket | None:
        """The acker's lookup (another thread: one dict read, atomic)."""
        conn = self._by_ident.get(ident)
        return conn.sock if conn is not None else None

    def send_acks(self, frames: Frames) -> None:
        """Send a durable batch's acks to lane connections, in order, on the
        acker's thread unless they are few (actors/writer/laneacker.py). A
        connection gone meanwhile is counted (`lane_acks_dropped_total`)."""
        self._acker.send(frames)

    def send(self, ident: bytes, frame: bytes) -> str | None:
        """Send `frame` to lane connection `ident`: "sent"; "not_reading" (its
        buffer is full), "gone", "too_large" (over what a packet can hold): not
        sent; None when `ident` is no lane connection (a ROUTER peer)."""
        conn = self._by_ident.get(ident)
        if conn is None:
            return None
        try:
            conn.sock.send(frame, _DONTWAIT)
        except BlockingIOError:
            return "not_reading"
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                return "too_large"
            self._close(conn)
            return "gone"
        return "sent"

    # --- housekeeping -------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Close connections that sent no hello in time; accept again after a pause."""
        if self._pending:
            for conn in [c for c in self._pending.values()
                         if now - c.opened_at > HELLO_TIMEOUT_S]:
                self.counters.hello_timeouts_total += 1
                self._close(conn)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            with contextlib.suppress(OSError):
                self._epoll.register(self._listener.fileno(), select.EPOLLIN)

    def _answer_and_close(self, sock: socket.socket, exc: ProtocolError) -> None:
        with contextlib.suppress(OSError):
            sock.send(protocol.error_frame(exc, None), _DONTWAIT)
        sock.close()

    def _forget(self, conn: Connection) -> None:
        fd = conn.sock.fileno()
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        self._by_fd.pop(fd, None)
        self._pending.pop(fd, None)
        self._by_ident.pop(conn.ident, None)
        self.counters.closed_total += 1

    def _close(self, conn: Connection) -> None:
        self._forget(conn)
        self._acker.close_socket(conn.sock)  # after acks queued for it, if any

    def values(self) -> dict[str, int | float]:
        c = self.counters
        return {"lane_connections": len(self._by_fd),
                "lane_accepted_total": c.accepted_total,
                "lane_refused_total": c.refused_total,
                "lane_closed_total": c.closed_total,
                "lane_hello_timeouts_total": c.hello_timeouts_total,
                "lane_acks_dropped_total": self._acker.dropped_total}

    def close(self) -> None:
        self._acker.stop()
        for conn in list(self._by_fd.values()):
            self._close(conn)
        self._epoll.close()
        self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
