"""`supervisor status`'s request on the control socket, without pydantic.

It loads only msgpack and the standard library's socket: it speaks ZMTP
itself (supervisor/zmtp.py) and checks the reply by hand; a reply that is not
a well-formed `status_reply` counts as none (the caller falls back to
run/status.json, marked stale). See docs/decisions.md ("`supervisor status`
decodes its reply without pydantic").
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack

from broker.statedir import StateDir
from supervisor import zmtp

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
RECONNECT_S = 0.1  # libzmq's default reconnect interval


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


def _credential(state_dir: StateDir) -> tuple[bytes, bytes] | None:
    """The operator's PLAIN credential when the state directory has one
    (`keys/operator.key`, written by the authenticated control socket's keyring:
    lines magic, name, password, mint), read without the auth module. No key
    file: a NULL connection, as before."""
    try:
        lines = (state_dir.root / "keys" / "operator.key").read_bytes().split(b"\n")
    except OSError:
        return None
    if len(lines) >= 3 and lines[1] and lines[2]:
        return lines[1], lines[2]
    return None


def _connect(state_dir: StateDir, deadline: float) -> zmtp.Dealer:
    """A handshaken connection to the control socket by `deadline`, else
    NoAnswerError. Like a DEALER's reconnects: a socket not yet bound, a
    connection dropped or a credential refused in the handshake (under load the
    ZAP handler may answer late) is tried again every RECONNECT_S."""
    path = state_dir.endpoint("supervisor").removeprefix("ipc://")
    plain = _credential(state_dir)
    while True:
        try:
            return zmtp.Dealer(path, deadline, plain=plain, max_frame_bytes=MAX_FRAME_BYTES)
        except (OSError, zmtp.ZmtpError) as exc:
            pause = min(RECONNECT_S, deadline - time.monotonic())
            if pause <= 0:
                raise NoAnswerError(f"no connection to the control socket: {exc}") from exc
            time.sleep(pause)


def ask_status(state_dir: StateDir, timeout_s: float) -> dict[str, Any]:
    """The supervisor's `status_reply` as plain data (with `kind`, without `v`).

    Raises NoAnswerError (no valid reply within `timeout_s`) or RefusedError."""
    msg_id = f"st{os.getpid():x}.{time.monotonic_ns():x}"
    frame = msgpack.packb({"kind": "status_request", "msg_id": msg_id, "v": PROTOCOL_VERSION},
                          use_bin_type=True)
    deadline = time.monotonic() + timeout_s
    while True:
        dealer = _connect(state_dir, deadline)
        try:
            dealer.send(frame)
            while True:
                try:
                    reply = msgpack.unpackb(dealer.recv(), raw=False, strict_map_key=True,
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
        except zmtp.ZmtpError as exc:
            # dropped after the handshake: the request may be lost, so ask again
            # on a new connection (status is a read: asking twice is harmless)
            if time.monotonic() >= deadline:
                raise NoAnswerError(f"no status reply within {timeout_s}s") from exc
        finally:
            dealer.close()
