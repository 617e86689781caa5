"""The starter's first start of the system children (supervisor/runtime/starter.py):
the writer, broker, procs and subagents wait for the zygote's `ready` and are
then asked of it (a `run` request with their credential); a zygote not ready
within ZYGOTE_READY_WAIT_S of its start, or a custom command, starts a fresh
interpreter; an operator's stop takes back a child still waiting. The zygote
here is our end of a socketpair: the test speaks its side of the wire."""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterator

import pytest

from actors.zygotelink import ZygoteLink
from broker.statedir import StateDir
from supervisor.config import ChildSpec, load
from supervisor.runtime import requests
from supervisor.runtime.children import Child
from supervisor.runtime.loop import Runtime
from supervisor.runtime.starter import ZYGOTE_READY_WAIT_S

T0 = 100.0  # the zygote's start (monotonic, as the runtime sees it)


@pytest.fixture
def link() -> Iterator[ZygoteLink]:
    """A link whose zygote is `link.theirs`, our other end of the socketpair."""
    theirs, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.settimeout(5.0)
    link = ZygoteLink([], {})
    link.sock, link.pid = ours, 2**22 + 1  # never a real pid of ours
    link.theirs = theirs  # type: ignore[attr-defined]
    try:
        yield link
    finally:
        theirs.close()
        link.close()


@pytest.fixture
def zygote_end(link: ZygoteLink) -> socket.socket:
    theirs: socket.socket = link.theirs  # type: ignore[attr-defined]
    return theirs


@pytest.fixture
def runtime(state_dir: StateDir, link: ZygoteLink,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Runtime, list[str]]]:
    rt = Runtime(load(None), state_dir)
    rt.starter.zygote = link
    rt.starter.zygote_started_at = T0
    fresh: list[str] = []
    monkeypatch.setattr(rt.starter, "spawn_fresh",
                        lambda child, _argv, _now: fresh.append(child.name))
    try:
        yield rt, fresh
    finally:
        rt.control.close()
        rt.ctx.destroy(linger=0)


def _pending(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@pytest.mark.timeout(30)
def test_a_system_child_waits_for_the_zygotes_ready_then_is_forked_by_it(
        runtime: tuple[Runtime, list[str]], zygote_end: socket.socket) -> None:
    rt, fresh = runtime
    for name in ("writer", "procs"):
        rt.starter.start(rt.children[name], T0 + 0.1)
    assert [c.name for c in rt.starter.awaiting] == ["writer", "procs"]
    assert all(rt.children[n].fork_pending for n in ("writer", "procs"))
    assert not _pending(zygote_end)  # nothing asked before `ready`
    rt.starter.serve_awaiting(T0 + ZYGOTE_READY_WAIT_S / 2)
    assert not _pending(zygote_end) and fresh == []

    zygote_end.send(b"ready 4000")
    rt.starter.on_replies(T0 + 1.0)
    asked = []
    for _ in range(2):
        data, fds, _flags, _addr = socket.recv_fds(zygote_end, 8192, 2)
        asked.append(data.split(b" ", 3)[:3])
        assert len(fds) == 1  # the child's credential pipe
        for fd in fds:
            os.close(fd)
    assert asked == [[b"run", b"writer", b"actors.writer"],
                     [b"run", b"procs", b"actors.procs"]]
    assert rt.starter.awaiting == [] and rt.starter.in_flight == 2 and fresh == []

    zygote_end.send(b"forked writer 4242")
    rt.starter.on_replies(T0 + 1.1)
    assert rt.children["writer"].pid == 4242 and not rt.children["writer"].fork_pending


@pytest.mark.timeout(30)
def test_a_zygote_not_ready_in_time_or_a_custom_command_starts_a_fresh_interpreter(
        runtime: tuple[Runtime, list[str]], zygote_end: socket.socket) -> None:
    rt, fresh = runtime
    spec = ChildSpec(name="custom", kind="procs", command=["{python}", "-c", "pass"])
    rt.children["custom"] = Child(spec=spec, policy=spec.policy())
    rt.starter.start(rt.children["custom"], T0)
    assert fresh == ["custom"]  # a custom command never waits for the zygote

    rt.starter.start(rt.children["broker"], T0 + 0.1)
    rt.starter.serve_awaiting(T0 + ZYGOTE_READY_WAIT_S - 0.01)
    assert fresh == ["custom"]
    rt.starter.serve_awaiting(T0 + ZYGOTE_READY_WAIT_S)
    assert fresh == ["custom", "broker"]
    assert not rt.children["broker"].fork_pending and rt.starter.awaiting == []
    # past the bound, a start does not wait at all
    rt.starter.start(rt.children["subagents"], T0 + ZYGOTE_READY_WAIT_S + 1)
    assert fresh == ["custom", "broker", "subagents"]
    assert not _pending(zygote_end)


@pytest.mark.timeout(30)
def test_a_stop_takes_back_a_child_awaiting_the_zygote(
        runtime: tuple[Runtime, list[str]], zygote_end: socket.socket) -> None:
    rt, fresh = runtime
    child = rt.children["subagents"]
    rt.starter.start(child, T0)
    reply = requests.stop(rt, "m-1", "subagents", T0 + 0.2)
    assert reply.msg_id == "m-1" and child.state == "stopped" and not child.fork_pending
    zygote_end.send(b"ready 4000")
    rt.starter.on_replies(T0 + 0.3)
    assert not _pending(zygote_end) and fresh == []
