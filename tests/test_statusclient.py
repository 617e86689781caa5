"""The pydantic-free status request (supervisor/statusclient.py) agrees with
broker/protocol.py: its request decodes as a `status_request`, a reply encoded
by the protocol is accepted field for field, and a hostile reply is no answer.
A real ROUTER socket stands in for the supervisor's control socket."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from broker import protocol
from broker.pidlock import PidLock
from broker.statedir import StateDir
from supervisor import statusclient


@pytest.fixture
def router(state_dir: StateDir) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(state_dir.endpoint("supervisor"))
    yield sock
    sock.close(linger=0)
    ctx.term()


def _serve(sock: zmq.Socket[bytes], answer: Callable[[protocol.StatusRequest], list[bytes]],
           seen: list[protocol.Message]) -> threading.Thread:
    def run() -> None:
        if not sock.poll(10_000):
            return
        identity, frame = sock.recv_multipart()
        request = protocol.decode(frame)
        seen.append(request)
        assert isinstance(request, protocol.StatusRequest)
        for reply in answer(request):
            sock.send_multipart([identity, reply])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _reply(msg_id: str) -> protocol.StatusReply:
    child = protocol.ChildStatus(
        name="agent-1", kind="agent", pid=123, state="running", uptime_s=1.5, restarts=2,
        last_exit="signal SIGKILL", cpu_percent=0.5, rss_bytes=1 << 20, uss_bytes=1 << 19,
        heartbeat_age_s=0.2, values={"ready_ms": 12.5, "turns": 3},
        busy=protocol.Busy(op="tool_call", since_s=2.5))
    return protocol.StatusReply(msg_id=msg_id, supervisor_pid=99, state_dir="/x",
                                started_at=1.0, children=[child])


def test_a_protocol_reply_is_read_field_for_field(state_dir: StateDir,
                                                  router: zmq.Socket[bytes]) -> None:
    seen: list[protocol.Message] = []
    late = protocol.encode(_reply("someone-else"))
    thread = _serve(router, lambda req: [late, protocol.encode(_reply(req.msg_id))], seen)
    data = statusclient.ask_status(state_dir, timeout_s=10.0)
    thread.join(10)
    assert isinstance(seen[0], protocol.StatusRequest)
    expected = _reply(seen[0].msg_id).model_dump(mode="json")
    assert data == expected  # the late reply to another msg_id was skipped


def test_an_error_reply_is_a_refusal(state_dir: StateDir, router: zmq.Socket[bytes]) -> None:
    seen: list[protocol.Message] = []
    thread = _serve(router, lambda req: [protocol.encode(protocol.Error(
        msg_id=req.msg_id, code=protocol.ErrorCode.INVALID_MESSAGE, detail="no"))], seen)
    with pytest.raises(statusclient.RefusedError) as caught:
        statusclient.ask_status(state_dir, timeout_s=10.0)
    thread.join(10)
    assert caught.value.detail == "no"


@pytest.mark.parametrize("body", [
    {"kind": "status_reply", "supervisor_pid": "1", "state_dir": "/x", "started_at": 1.0,
     "children": []},
    {"kind": "status_reply", "supervisor_pid": 1, "state_dir": "/x", "started_at": 1.0,
     "children": [{"name": 5, "state": "running"}]},
    {"kind": "status_reply", "supervisor_pid": 1, "state_dir": "/x", "started_at": 1.0,
     "children": "all"},
    {"kind": "status_reply", "supervisor_pid": 1, "state_dir": "/x", "started_at": 1.0,
     "children": [{"name": "a", "state": "running", "busy": {"op": "x", "since_s": "1"}}]},
])
def test_a_malformed_reply_is_no_answer(state_dir: StateDir, router: zmq.Socket[bytes],
                                        body: dict[str, object]) -> None:
    seen: list[protocol.Message] = []
    garbage = b"\xc1not msgpack"

    def answer(req: protocol.StatusRequest) -> list[bytes]:
        frame = msgpack.packb({**body, "msg_id": req.msg_id, "v": 1}, use_bin_type=True)
        return [garbage, frame]

    thread = _serve(router, answer, seen)
    with pytest.raises(statusclient.NoAnswerError):
        statusclient.ask_status(state_dir, timeout_s=10.0)
    thread.join(10)


def test_the_status_path_imports_no_pydantic(state_dir: StateDir,
                                             router: zmq.Socket[bytes]) -> None:
    """`supervisor status` against a live control socket loads only what it needs
    (deliverable 9): no pydantic, no broker.protocol, no YAML, no structlog, and
    no pyzmq (supervisor/zmtp.py speaks the wire)."""
    seen: list[protocol.Message] = []
    thread = _serve(router, lambda req: [protocol.encode(_reply(req.msg_id))], seen)
    code = ("import sys; from supervisor.cli.main import main; rc = main(['status', '--json', "
            f"'--state-dir', {str(state_dir.root)!r}]); print(rc, sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('pydantic', 'yaml', 'structlog', 'broker', 'zmq')))")
    lock = PidLock(state_dir.lock_path)
    lock.acquire()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, timeout=60)
    finally:
        lock.release()
    thread.join(10)
    assert seen, "the command never asked the supervisor"
    assert '"agent-1"' in done.stdout
    loaded = done.stdout.strip().splitlines()[-1]
    assert loaded.startswith("0 ")
    for module in ("pydantic", "yaml", "structlog", "broker.protocol", "zmq"):
        assert f"'{module}" not in loaded, loaded


def test_the_operator_credential_is_presented_when_there_is_one(state_dir: StateDir) -> None:
    """A control socket that takes only authenticated connections (PLAIN + ZAP,
    as the authenticated runtime's) answers the status client holding keys/operator.key."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = state_dir.root / "keys"
    keys.mkdir(mode=0o700)
    (keys / "operator.key").write_bytes(b"corral-credential-1\noperator\ns3cret\n\n")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_plain(domain="*", passwords={"operator": "s3cret"})
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.bind(state_dir.endpoint("supervisor"))
    try:
        seen: list[protocol.Message] = []
        thread = _serve(sock, lambda req: [protocol.encode(_reply(req.msg_id))], seen)
        assert statusclient.ask_status(state_dir, timeout_s=10.0)["supervisor_pid"] == 99
        thread.join(10)
        (keys / "operator.key").write_bytes(b"corral-credential-1\noperator\nwrong\n\n")
        with pytest.raises(statusclient.NoAnswerError):  # refused in the handshake
            statusclient.ask_status(state_dir, timeout_s=1.0)
    finally:
        sock.close(linger=0)
        auth.stop()
        ctx.term()


def _drop_connections(listener: socket.socket, drops: int | None) -> threading.Thread:
    """Accept and close `drops` connections at once (None: until the listener closes)."""
    def run() -> None:
        for _ in itertools.repeat(None) if drops is None else range(drops):
            try:
                conn, _addr = listener.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_connection_dropped_before_the_send_is_no_answer_not_a_crash(
        state_dir: StateDir) -> None:
    """A connection dropped in its handshake (an injected fault; in CI a refused
    handshake under load) is retried until the deadline, and past it is
    NoAnswerError, never a raw socket error (which `supervisor status` would
    show as a traceback)."""
    path = state_dir.endpoint("supervisor").removeprefix("ipc://")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    always = _drop_connections(listener, drops=None)
    try:
        with pytest.raises(statusclient.NoAnswerError):
            statusclient.ask_status(state_dir, timeout_s=0.5)
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        listener.close()
        always.join(10)
    # dropped once, then a control socket binds the path: the retry is answered
    os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    once = _drop_connections(listener, drops=1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        seen: list[protocol.Message] = []

        def rebind() -> None:
            once.join(10)
            listener.close()
            os.unlink(path)
            router.bind(state_dir.endpoint("supervisor"))
            _serve(router, lambda req: [protocol.encode(_reply(req.msg_id))], seen).join(10)

        server = threading.Thread(target=rebind, daemon=True)
        server.start()
        assert statusclient.ask_status(state_dir, timeout_s=10.0)["supervisor_pid"] == 99
        server.join(10)
        assert len(seen) == 1
    finally:
        listener.close()
        router.close(linger=0)
        ctx.term()
