"""A ZMTP 3.0 DEALER over a Unix socket in plain Python, for `supervisor status`.

The command's cost is its start: pyzmq's import alone is about a third of it,
for one request and one reply on an `ipc://` endpoint. This module speaks the
wire (rfc.zeromq.org ZMTP 3.0: the 64-byte greeting, the NULL or PLAIN
handshake, length-prefixed frames) with the standard library's `socket`,
single-frame messages only, to the supervisor's ROUTER (libzmq accepts a 3.0
peer). Everything else in corral uses pyzmq. docs/supervisor.md.
"""

from __future__ import annotations

import socket
import struct
import time

_SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
_VERSION = b"\x03\x00"
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


class ZmtpError(Exception):
    """The connection closed, timed out, or broke the protocol."""


class RefusedHandshakeError(ZmtpError):
    """The peer answered the handshake with an ERROR command (e.g. a refused
    PLAIN credential)."""


def _greeting(mechanism: bytes) -> bytes:
    return _SIGNATURE + _VERSION + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _command(name: bytes, data: bytes) -> bytes:
    return _frame(bytes([len(name)]) + name + data, _COMMAND)


def _metadata(**properties: bytes) -> bytes:
    out = b""
    for key, value in properties.items():
        name = key.replace("_", "-").encode()
        out += bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return out


class Dealer:
    """One connection to a ROUTER at `path`, by `deadline` (time.monotonic()):
    every blocking step raises ZmtpError once the deadline has passed."""

    def __init__(self, path: str, deadline: float, *, plain: tuple[bytes, bytes] | None = None,
                 max_frame_bytes: int) -> None:
        self.deadline = deadline
        self.max_frame_bytes = max_frame_bytes
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._timeout()
            self.sock.connect(path)
            self._handshake(plain)
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def send(self, message: bytes) -> None:
        self._send(_frame(message, 0))

    def _send(self, data: bytes) -> None:
        self._timeout()
        try:
            self.sock.sendall(data)
        except OSError as exc:  # socket.timeout included
            raise ZmtpError(f"send failed: {exc}") from exc

    def recv(self) -> bytes:
        """The next message frame (commands such as PING are skipped)."""
        while True:
            flags, body = self._read_frame()
            if not flags & _COMMAND:
                return body

    def _timeout(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ZmtpError("deadline passed")
        self.sock.settimeout(remaining)

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            self._timeout()
            try:
                chunk = self.sock.recv(size - len(data))
            except OSError as exc:  # socket.timeout included
                raise ZmtpError(f"receive failed: {exc}") from exc
            if not chunk:
                raise ZmtpError("the peer closed the connection")
            data += chunk
        return data

    def _read_frame(self) -> tuple[int, bytes]:
        flags = self._read(1)[0]
        size = struct.unpack(">Q", self._read(8))[0] if flags & _LONG else self._read(1)[0]
        if size > self.max_frame_bytes:
            raise ZmtpError(f"frame of {size} bytes over the limit")
        return flags, self._read(size)

    def _expect(self, name: bytes) -> bytes:
        """The data of the next command, which must be `name` (ERROR: refused)."""
        flags, body = self._read_frame()
        if not flags & _COMMAND or not body or len(body) < 1 + body[0]:
            raise ZmtpError("expected a command in the handshake")
        got, data = body[1:1 + body[0]], body[1 + body[0]:]
        if got == b"ERROR":
            raise RefusedHandshakeError(data[1:1 + data[0]].decode(errors="replace")
                                        if data else "refused")
        if got != name:
            raise ZmtpError(f"expected {name!r} in the handshake, got {got!r}")
        return data

    def _handshake(self, plain: tuple[bytes, bytes] | None) -> None:
        mechanism = b"PLAIN" if plain is not None else b"NULL"
        self._send(_greeting(mechanism))
        peer = self._read(64)
        if peer[:1] != b"\xff" or peer[9:10] != b"\x7f" or peer[10] < 3:
            raise ZmtpError("the peer does not speak ZMTP 3")
        if peer[12:32].rstrip(b"\x00") != mechanism:
            raise ZmtpError(f"the peer's mechanism is {peer[12:32].rstrip(bytes(1))!r}")
        metadata = _metadata(Socket_Type=b"DEALER", Identity=b"")
        if plain is None:
            self._send(_command(b"READY", metadata))
        else:
            user, password = plain
            self._send(_command(b"HELLO", bytes([len(user)]) + user
                                       + bytes([len(password)]) + password))
            self._expect(b"WELCOME")
            self._send(_command(b"INITIATE", metadata))
        self._expect(b"READY")
