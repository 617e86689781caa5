"""procs settles ended commands while its request queue never empties (issue
16): a client keeps a window of `bash_poll` requests outstanding (each one
answered is replaced at once, so procs always finds more waiting), and a
background command that ends meanwhile must get its `.end` file and its
`proc_exit` fact within a deadline. Before the fix procs served requests
until none was left before it reaped, so under such a stream it never
noted any end (the janitor prunes only ended jobs)."""

from __future__ import annotations

import os
import time

import pytest

from actors.procs.registry import end_path
from broker import protocol
from broker.requester import new_msg_id
from tests.processes import wait_for
from tests.test_procs import SESSION, Stack, read_all, stack  # noqa: F401 - the fixture

pytestmark = pytest.mark.process
WINDOW = 64  # requests kept outstanding
# a starved job never settles, so the bound only needs to outlast slow fsyncs: at
# load ~10 a turn of 64 polls (an fsync each) can take seconds
DEADLINE_S = 30.0
OUTPUT = 100_000  # bytes of the polled job's log: distinct cursors to poll


def test_an_ended_command_is_settled_under_a_stream_of_requests(
    stack: Stack,  # noqa: F811 - the fixture imported above
) -> None:
    workdir = str(stack.workdir)
    # a job with output for the flood to poll: each poll returns a byte at a
    # new cursor, so procs records a new fact per request (a durable append,
    # a writer round trip with its fsync, as for agents' polls)
    busy = stack.client.start(f"head -c {OUTPUT} /dev/zero", workdir).proc_id
    assert busy is not None
    read_all(stack.client, busy)
    # the job whose end must be noted: it waits for a file the test creates
    # once the flood is running, so it ends while the queue is full
    gate = stack.workdir / "go"
    ending = stack.client.start(f"while [ ! -e {gate} ]; do sleep 0.01; done; echo ended",
                                workdir)
    log_path = os.path.join(str(stack.state.agent_dir(SESSION)), ".procs",
                            f"{ending.proc_id}.log")

    sent = 0

    def poll() -> None:
        nonlocal sent
        stack.peer.send("procs", protocol.BashPoll(
            msg_id=new_msg_id("f"), session=SESSION, proc_id=busy, cursor=sent % OUTPUT,
            max_bytes=1))
        sent += 1

    outstanding = 0
    answered = 0
    for _ in range(WINDOW):
        poll()
        outstanding += 1
    gate.touch()
    settled_at: float | None = None
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        item = stack.peer.recv(0.5)
        if item is not None:
            assert isinstance(item[1], protocol.ProcOutput), item
            answered += 1
            outstanding -= 1
            poll()  # the queue never drains
            outstanding += 1
        if os.path.exists(end_path(log_path)):
            settled_at = time.monotonic()
            break
    assert settled_at is not None, (
        f"no .end for {ending.proc_id} within {DEADLINE_S} s under a stream of "
        f"{answered} requests")
    while outstanding:  # drain the window before the fixture closes the peer
        item = stack.peer.recv(5.0)
        assert item is not None, f"{outstanding} polls unanswered"
        outstanding -= 1
    wait_for(lambda: any(f["proc_id"] == ending.proc_id for f in stack.facts("proc_exit")),
             DEADLINE_S, "the proc_exit fact")
