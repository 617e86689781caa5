"""The lane's acker (actors/writer/laneacker.py): a batch's acks leave in
order on its thread, few acks go inline when it is idle, and a socket the
loop closes while acks for it are queued is closed only after them (so its
fd is never reused under a queued ack)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from actors.writer.laneacker import INLINE_ACKS, LaneAcker
from tests.processes import wait_for


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.settimeout(30)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_acks_leave_in_order_and_a_close_waits_for_them(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    gate = threading.Event()
    looked_up: list[bytes] = []

    def resolve(ident: bytes) -> socket.socket | None:
        looked_up.append(ident)
        gate.wait(30)  # holds the acker's thread busy until released
        return ours if ident == b"c" else None

    acker = LaneAcker(resolve)
    frames = [(b"c", f"ack-{i}".encode()) for i in range(INLINE_ACKS + 3)]
    acker.send(frames)  # more than the inline few: queued for the thread
    wait_for(lambda: bool(looked_up), 30, "the acker to take the batch")
    assert not acker.idle
    acker.send([(b"c", b"late")])  # busy: queued behind, not sent inline
    acker.send([(b"gone", b"x")])  # a connection closed meanwhile: dropped, counted
    acker.close_socket(ours)  # busy: closed after what is queued
    assert ours.fileno() != -1
    gate.set()
    got = [theirs.recv(64) for _ in range(len(frames) + 1)]
    assert got == [f for _, f in frames] + [b"late"]
    assert theirs.recv(64) == b""  # then closed
    wait_for(lambda: acker.idle, 30, "the acker to finish")
    assert (acker.sent_total, acker.dropped_total) == (len(frames) + 1, 1)
    acker.stop()


def test_few_acks_go_inline_when_idle_and_failures_are_counted(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    caller: list[str] = []

    def resolve(ident: bytes) -> socket.socket | None:
        caller.append(threading.current_thread().name)
        return ours

    acker = LaneAcker(resolve)
    acker.send([(b"c", b"one")])
    assert caller == [threading.current_thread().name]  # sent by the caller itself
    assert theirs.recv(64) == b"one" and acker.idle
    theirs.close()  # the client is gone: the send fails, counted, the thread lives
    acker.send([(b"c", b"a")] * (INLINE_ACKS + 1))
    wait_for(lambda: acker.idle, 30, "the acker to finish")
    assert acker.dropped_total == INLINE_ACKS + 1
    acker.close_socket(ours)  # idle: at once
    assert ours.fileno() == -1
    acker.stop()
