"""The request/reply client's append path (broker/requester.py, the writer's
client): its short path for the common case (the socket takes the frame, the
first frame back is its ack) must answer every other case exactly as the
general path does. Real sockets: a ROUTER in a thread of the test plays the
writer, answering with scripted frames."""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from actors.writer.client import WriterClient
from broker import appendwire, protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.requester import Requester, new_msg_id
from broker.statedir import StateDir

Script = Callable[[zmq.Socket[bytes], bytes, bytes], None]


class ScriptedWriter:
    """A ROUTER answering each request it receives with `script(sock, ident,
    frame)`; every request frame it saw is kept, in order."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.seen: list[bytes] = []
        self.script: Script = ack_it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            self.seen.append(frame)
            self.script(self.sock, ident, frame)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)


def msg_id_of(frame: bytes) -> str:
    request = appendwire.decode_request(frame)
    assert request is not None
    return request.msg_id


def ack_it(sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
    sock.send_multipart([ident, appendwire.encode_append_ok(msg_id_of(frame), 7, False)])


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    # not under a state directory's run/: no credential, as a plain ROUTER
    return f"ipc://{tmp_path}/w.sock"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def writer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> Iterator[ScriptedWriter]:
    server = ScriptedWriter(ctx, endpoint)
    yield server
    server.close()


def append_frame(msg_id: str, key: str = "k1") -> bytes:
    frame = appendwire.encode_append(msg_id=msg_id, origin="a", key=key, stream="agent/a",
                                     event="turn", payload=b"{}", ledger=None)
    assert frame is not None
    return frame


def warmed(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, timeout_s: float,
           limits: protocol.Limits = protocol.DEFAULT_LIMITS,
           short_path_only: bool = False) -> Requester:
    """A requester past its first request: the next one takes the short path
    (with `short_path_only`, the general one fails the test)."""
    req = Requester(ctx, endpoint, limits=limits)
    msg_id = new_msg_id("a")
    req.request_append(append_frame(msg_id, "warm"), msg_id, "append", timeout_s=timeout_s)
    if short_path_only:
        def general(*args: object, **kwargs: object) -> None:
            raise AssertionError("the general path was taken")
        req._exchange = general  # type: ignore[method-assign]
    return req


def test_late_and_garbled_replies_are_skipped_without_a_resend(
        ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, writer: ScriptedWriter) -> None:
    req = warmed(ctx, endpoint, 5.0, short_path_only=True)

    def late_first(sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
        msg_id = msg_id_of(frame)
        sock.send_multipart([ident, appendwire.encode_append_ok("a-earlier", 3, False)])
        sock.send_multipart([ident, b"\xc1 not msgpack"])
        sock.send_multipart([ident, protocol.error_frame(
            protocol.ProtocolError("internal_error", "not yours"), "a-earlier")])
        sock.send_multipart([ident, appendwire.encode_append_ok(msg_id, 9, True)])

    writer.script = late_first
    msg_id = new_msg_id("a")
    ack = req.request_append(append_frame(msg_id), msg_id, "append", timeout_s=5.0)
    assert ack == appendwire.AppendOkFrame(msg_id=msg_id, seq=9, duplicate=True, v=1)
    assert req.reconnects == 0
    assert len(writer.seen) == 2  # the warm-up and this one, sent once
    req.close()


def test_an_error_reply_is_raised_with_its_code(
        ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, writer: ScriptedWriter) -> None:
    req = warmed(ctx, endpoint, 5.0, short_path_only=True)

    def refuse(sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
        exc = protocol.ProtocolError("forbidden", "not your session")
        sock.send_multipart([ident, protocol.error_frame(exc, msg_id_of(frame))])

    writer.script = refuse
    msg_id = new_msg_id("a")
    with pytest.raises(RemoteError) as refused:
        req.request_append(append_frame(msg_id), msg_id, "append", timeout_s=5.0)
    assert refused.value.code == "forbidden"
    req.close()


def test_an_unanswered_append_is_sent_again_the_same_on_a_new_socket(
        ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, writer: ScriptedWriter) -> None:
    # 1 s an attempt: the resend must be answered within its own attempt, even
    # with the scripted writer's thread waiting for a core under load
    req = warmed(ctx, endpoint, 1.0)
    answered = threading.Event()

    def second_time(sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
        if len(writer.seen) == 3:  # the warm-up, the lost one, the resend
            answered.set()  # before the ack: the client may read it at once
            ack_it(sock, ident, frame)

    writer.script = second_time
    msg_id = new_msg_id("a")
    frame = append_frame(msg_id)
    ack = req.request_append(frame, msg_id, "append", timeout_s=1.0, retries=3)
    assert answered.is_set() and ack.msg_id == msg_id
    assert req.reconnects == 1
    assert writer.seen[1:] == [frame, frame]

    writer.script = lambda sock, ident, frame: None  # never answers
    msg_id = new_msg_id("a")
    with pytest.raises(RequestTimeoutError):
        req.request_append(append_frame(msg_id, "k2"), msg_id, "append", timeout_s=0.2,
                           retries=1)
    assert req.reconnects == 2
    req.close()


def test_an_ack_appendwire_cannot_vouch_for_is_decoded_by_the_protocol(
        ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, writer: ScriptedWriter) -> None:
    tight = protocol.Limits(max_array_len=8)  # below a group's bound: appendwire stands aside
    req = warmed(ctx, endpoint, 5.0, limits=tight)
    msg_id = new_msg_id("a")
    ack = req.request_append(append_frame(msg_id), msg_id, "append", timeout_s=5.0)
    assert ack == protocol.AppendOk(msg_id=msg_id, seq=7, duplicate=False)
    req.close()


def test_the_client_returns_the_ack_however_the_writer_encoded_it(
        ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, writer: ScriptedWriter,
        tmp_path: Path) -> None:
    def by_the_model(sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
        ok = protocol.AppendOk(msg_id=msg_id_of(frame), seq=11, duplicate=False)
        sock.send_multipart([ident, protocol.encode(ok)])  # `v` first, pydantic's order

    writer.script = by_the_model
    client = WriterClient(ctx, StateDir(tmp_path / ".corral"), "a", endpoint=endpoint,
                          timeout_s=5.0, retries=1)
    for i in range(3):
        ack = client.append("agent/a", "turn", {"i": i}, key=f"k{i}")
        assert (type(ack), ack.seq, ack.duplicate) == (appendwire.AppendOkFrame, 11, False)
    client.close()


def _child_msg_id(out: mp.connection.Connection) -> None:
    out.send(new_msg_id("a"))


def test_msg_ids_are_unique_and_a_forked_child_makes_its_own() -> None:
    ids = {new_msg_id("a") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(appendwire.decode_request(append_frame(i)) is not None for i in ids)
    recv, send = mp.get_context("fork").Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=_child_msg_id, args=(send,))
    child.start()
    theirs = recv.recv()
    child.join(timeout=10)
    ours = new_msg_id("a")
    # "a<pid>.<start>.<n>": the child's pid and start, not this process's
    assert theirs.rsplit(".", 1)[0] != ours.rsplit(".", 1)[0]
    assert theirs.split(".")[0] == f"a{child.pid:x}"
