"""The CLI's side of the control socket: one request, one reply, short timeouts.

Whether a supervisor runs is answered by a flock probe before any ZeroMQ
import. See docs/protocol.md ("Supervision (`run/supervisor.sock`)").
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

from typing import TYPE_CHECKING

from broker import pidlock
from broker.statedir import StateDir

if TYPE_CHECKING:
    from typing import TypeAlias

    from broker import protocol

    Request: TypeAlias = (
        protocol.StatusRequest | protocol.SignalRequest | protocol.RestartRequest
        | protocol.StopRequest | protocol.StartRequest | protocol.RemoveRequest
        | protocol.ReloadRequest | protocol.SpawnRequest
    )


class NoSupervisorError(Exception):
    """No supervisor holds this state directory."""


def running(state_dir: StateDir) -> bool:
    return pidlock.is_held(state_dir.lock_path)


def ask(state_dir: StateDir, message: Request, timeout_s: float = 2.0,
        retries: int = 0) -> protocol.Message:
    """Send one control request; raises NoSupervisorError, RequestTimeoutError, RemoteError."""
    import zmq

    from broker import auth
    from broker.requester import Requester

    if not running(state_dir):
        raise NoSupervisorError(str(state_dir.root))
    credential = auth.operator_credential(state_dir)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    requester = Requester(ctx, state_dir.endpoint("supervisor"), credential=credential)
    try:
        return requester.request(message, timeout_s=timeout_s, retries=retries)
    finally:
        requester.close()
        ctx.term()
