"""Pipelined group commit (actors/writer/process.py `_collect`): the batch
staged while one is being made durable goes to the disk before the durable
one's acks are sent. The rule that must survive it: no record is ever
acknowledged before the fdatasync of its own batch returned. An injected EIO
on one fdatasync, with many appenders in flight, must leave every record of
that batch unacknowledged, and every acknowledged record durable with its seq."""

from __future__ import annotations

import threading

import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.process import EXIT_IO
from actors.writer.segments import FAULT_ENV_FAIL_SYNC_AT
from broker.errors import RemoteError, RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker
from tests.test_writer import ctx, start_writer, wal_records

pytestmark = pytest.mark.process

__all__ = ["ctx"]  # the fixture, used by name

FAILING_SYNC = 25
APPENDERS = 12


def _append_until_refused(ctx: zmq.Context[zmq.Socket[bytes]], state_dir: StateDir, name: str,
                          acked: list[tuple[str, int]]) -> None:
    with WriterClient(ctx, state_dir, name, timeout_s=1.0, retries=0) as client:
        for n in range(10_000):
            key = f"{name}-{n}"
            try:
                if n % 3 == 2:  # groups too: one batch holds a group whole
                    reply = client.append_many(f"agent/{name}", [
                        ("turn", b"{}", key, None), ("tool_call", b"[1]", key + "b", None)])
                    acked += [(key, reply.seq), (key + "b", reply.seq + 1)]
                else:
                    acked.append((key, client.append(f"agent/{name}", "turn", {"n": n},
                                                     key=key).seq))
            except (RequestTimeoutError, RemoteError):
                return


def test_a_failed_fdatasync_under_pipelined_batches_acknowledges_nothing_of_its_batch(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx,
                          env={FAULT_ENV_FAIL_SYNC_AT: str(FAILING_SYNC)})
    acked: dict[str, list[tuple[str, int]]] = {f"a{i}": [] for i in range(APPENDERS)}
    threads = [threading.Thread(target=_append_until_refused, args=(ctx, state_dir, name, out))
               for name, out in acked.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert writer.wait(timeout=10) == EXIT_IO
    assert "injected EIO" in processes.output("writer")

    # every batch was written with one write() and synced with one fdatasync, in
    # order: the FAILING_SYNC-th batch in the file is the one whose sync failed
    records = wal_records(state_dir)
    spans: list[tuple[int, int]] = []
    for record in records:
        span = tuple(record["batch"])  # type: ignore[arg-type]
        if not spans or spans[-1] != span:
            spans.append(span)  # type: ignore[arg-type]
    assert len(spans) == FAILING_SYNC, spans  # the failed batch was written, nothing after it
    failed_first, failed_last = spans[-1]
    all_acked = [pair for pairs in acked.values() for pair in pairs]
    early = [(key, seq) for key, seq in all_acked if failed_first <= seq <= failed_last]
    assert early == [], f"acknowledged before its batch was durable: {early}"
    assert all_acked, "no append was acknowledged before the fault"
    # and what was acknowledged is in the WAL under its seq
    by_seq = {int(r["seq"]): r["key"] for r in records}  # type: ignore[call-overload]
    assert all(by_seq[seq] == key for key, seq in all_acked)


def test_the_pacer_holds_only_a_batch_under_half_the_last_and_never_past_its_bound() -> None:
    from actors.writer.groupcommit import CommitPacer

    pacer = CommitPacer(hold_max_s=0.002)
    assert pacer.hold_s(1, now=10.0) == 0.0  # nothing submitted yet: at once
    pacer.submitted(1)
    pacer.staged(now=10.0)
    assert pacer.hold_s(1, now=10.0) == 0.0  # a lone appender: batches of one, never held
    pacer.submitted(20)
    pacer.staged(now=20.0)
    assert pacer.hold_s(3, now=20.0005) == pytest.approx(0.0015)  # 3 < 20 / 2: wait for more
    assert pacer.hold_s(10, now=20.0005) == 0.0  # half the last batch: at once
    assert pacer.hold_s(3, now=20.0025) == 0.0  # held long enough
    assert pacer.hold_s(0, now=20.0) == 0.0  # acks only (no record): at once
    pacer.submitted(3)
    assert pacer.since is None


def test_a_lone_appender_is_never_held_after_its_own_multi_record_append() -> None:
    """The pacer counts appenders, not records: an agent's step appends a
    group (turn .. tool_start) then its tool_result alone; the single append
    answers as many appenders as the group did, so it goes at once."""
    from actors.writer.groupcommit import Batch, CommitPacer

    group, single = Batch(), Batch()
    group.bodies = [(b"r", 0)] * 4
    group.many_acks = [(b"agent-1", "m1", 1, 4, None, False)]
    single.bodies = [(b"r", 0)]
    single.acks = [(b"agent-1", "m2", 5, False)]
    assert (group.waiting(), single.waiting(), Batch().waiting()) == (1, 1, 0)
    pacer = CommitPacer(hold_max_s=0.002)
    pacer.submitted(group.waiting())
    pacer.staged(now=30.0)
    assert pacer.hold_s(single.waiting(), now=30.0) == 0.0
