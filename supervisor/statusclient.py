"""`supervisor status`'s request on the control socket, without pydantic.

See docs/decisions.md ("`supervisor status` decodes its reply without
pydantic").
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import zmq

from broker.statedir import StateDir

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024


class NoAnswerError(Exception):
    """The supervisor did not answer in time (or answered garbage)."""


class RefusedError(Exception):
    """The supervisor answered with an `error` reply."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


_CHILD_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,), "kind": (str,), "state": (str,), "restarts": (int,),
    "pid": (int, type(None)), "uptime_s": (int, float, type(None)),
    "last_exit": (str, type(None)), "cpu_percent": (int, float, type(None)),
    "rss_bytes": (int, type(None)), "uss_bytes": (int, type(None)),
    "heartbeat_age_s": (int, float, type(None)), "values": (dict,),
}


def _valid(reply: dict[str, Any]) -> bool:
    if not isinstance(reply.get("supervisor_pid"), int) \
            or not isinstance(reply.get("state_dir"), str) \
            or not isinstance(reply.get("started_at"), (int, float)):
        return False
    children = reply.get("children")
    if not isinstance(children, list):
        return False
    for child in children:
        if not isinstance(child, dict):
            return False
        for key, types in _CHILD_FIELDS.items():
            if key in child and not isinstance(child[key], types):
                return False
        if not isinstance(child.get("name"), str) or not isinstance(child.get("state"), str):
            return False
        busy = child.get("busy")
        if busy is not None and not (isinstance(busy, dict) and isinstance(busy.get("op"), str)
                                     and isinstance(busy.get("since_s"), (int, float))):
            return False
    return True


def _authenticate(sock: zmq.Socket[bytes], state_dir: StateDir) -> None:
    """Present the operator's credential when the state directory has one
    (`keys/operator.key`, written by the authenticated control socket's keyring:
    lines magic, name, password, mint), without importing the auth module (it
    loads zmq.auth and asyncio). No key file: a plain connection, as before."""
    try:
        lines = (state_dir.root / "keys" / "operator.key").read_bytes().split(b"\n")
    except OSError:
        return
    if len(lines) >= 3 and lines[1] and lines[2]:
        sock.setsockopt(zmq.PLAIN_USERNAME, lines[1])
        sock.setsockopt(zmq.PLAIN_PASSWORD, lines[2])


def _send_by(sock: zmq.Socket[bytes], frame: bytes, deadline: float) -> None:
    """Send `frame` once a connection takes it, by `deadline`, else raise
    NoAnswerError. A connection can be ready and then refused in its
    handshake before the send (its pipe gone: zmq.Again); the DEALER
    reconnects, and a refused credential is refused again until the deadline."""
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLOUT):
            raise NoAnswerError("no connection to the control socket")
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            continue  # the connection went before the send: wait for the next one
        return


def ask_status(state_dir: StateDir, timeout_s: float) -> dict[str, Any]:
    """The supervisor's `status_reply` as plain data (with `kind`, without `v`).

    Raises NoAnswerError (no valid reply within `timeout_s`) or RefusedError."""
    msg_id = f"st{os.getpid():x}.{time.monotonic_ns():x}"
    frame = msgpack.packb({"kind": "status_request", "msg_id": msg_id, "v": PROTOCOL_VERSION},
                          use_bin_type=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        _authenticate(sock, state_dir)
        sock.connect(state_dir.endpoint("supervisor"))
        deadline = time.monotonic() + timeout_s
        _send_by(sock, frame, deadline)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                raise NoAnswerError(f"no status reply within {timeout_s}s")
            try:
                reply = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=True,
                                        max_ext_len=0)
            except (ValueError, TypeError, msgpack.UnpackException):
                continue
            if not isinstance(reply, dict) or reply.get("msg_id") != msg_id \
                    or reply.pop("v", None) != PROTOCOL_VERSION:
                continue
            if reply.get("kind") == "error":
                raise RefusedError(str(reply.get("code")), str(reply.get("detail")))
            if reply.get("kind") == "status_reply" and _valid(reply):
                return reply
            raise NoAnswerError("the status reply is malformed")
    finally:
        sock.close(linger=0)
        ctx.term()
