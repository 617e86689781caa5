"""The writer as a real process over a real ipc socket with real fdatasync:
acknowledged appends are durable, gapless and written once; bad input is
refused with a typed error and changes nothing; start-up repairs a torn tail
and refuses damage before it; a failed fdatasync is never acknowledged."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from actors.writer.client import WriterClient
from actors.writer.process import EXIT_CORRUPT, EXIT_IO, EXIT_LOCKED
from actors.writer.segments import FAULT_ENV_FAIL_SYNC_AT
from actors.writer.wal import TornTail, iter_segment, list_segments
from broker import auth, protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start_writer(
    processes: ProcessTracker,
    state_dir: StateDir,
    ctx: zmq.Context[zmq.Socket[bytes]],
    *extra: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    proc = processes.spawn(
        ["-m", "actors.writer", "--state-dir", str(state_dir.root), *extra], name="writer", env=env
    )
    probe = WriterClient(ctx, state_dir, "probe")
    try:

        def answered() -> bool:
            assert proc.poll() is None, processes.output("writer")
            try:
                probe.ping(timeout_s=0.05, retries=0)
            except RequestTimeoutError:
                return False
            return True

        wait_for(answered, 30, "the writer to answer a ping")  # imports: 5-10 s under load
    finally:
        probe.close()
    return proc


def wal_records(state_dir: StateDir) -> list[dict[str, object]]:
    out = []
    for _, path in list_segments(state_dir.wal_dir):
        for _, item in iter_segment(path):
            assert not isinstance(item, TornTail)
            out.append(json.loads(item.line))
    return out


def wal_bytes(state_dir: StateDir) -> bytes:
    return b"".join(p.read_bytes() for _, p in list_segments(state_dir.wal_dir))


def kill_and_reap(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_appends_are_acked_in_gapless_order_and_read_back_by_stream(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a")
    acks = [
        client.append("agent/a" if i % 2 else "agent/b", "turn", {"i": i}, key=f"t{i}").seq
        for i in range(40)
    ]
    assert acks == list(range(1, 41))
    records = list(client.read_stream("agent/a", from_seq=10, page=3))
    assert [r.seq for r in records] == list(range(10, 41, 2))  # odd i -> agent/a -> even seq
    assert records[0].payload() == {"i": 9}
    assert [r["seq"] for r in wal_records(state_dir)] == list(range(1, 41))
    page = client.read_page("agent/none", 1)
    assert page.records == [] and not page.more and page.head_seq == 40
    client.close()


def test_a_retried_key_is_written_once_and_answered_with_its_seq_across_restarts(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a", timeout_s=0.5, retries=20)
    first = client.append("agent/a", "turn", {"n": 1}, key="turn-1")
    client.append("agent/a", "turn", {"n": 2}, key="turn-2")
    again = client.append("agent/a", "turn", {"n": 1}, key="turn-1")
    assert (again.seq, again.duplicate, first.duplicate) == (first.seq, True, False)
    with WriterClient(ctx, state_dir, "agent-b") as other:
        other_origin = other.append("agent/b", "turn", {}, key="turn-1")
    assert other_origin.seq == 3 and not other_origin.duplicate  # keys are per origin

    writer.send_signal(signal.SIGTERM)
    assert writer.wait(timeout=10) == 0
    writer = start_writer(processes, state_dir, ctx)
    assert client.append("agent/a", "turn", {"n": 2}, key="turn-2").seq == 2

    kill_and_reap(writer)  # no clean checkpoint this time: the tail scan must rebuild keys
    start_writer(processes, state_dir, ctx)
    late = client.append("agent/a", "turn", {"n": 1}, key="turn-1")
    assert (late.seq, late.duplicate) == (1, True)
    assert len(wal_records(state_dir)) == 3
    client.close()


def test_bad_frames_get_typed_errors_and_nothing_durable_changes(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx, "--max-frame-bytes", "65536")
    client = WriterClient(ctx, state_dir, "agent-a")
    client.append("agent/a", "turn", {"ok": True}, key="k1")
    before = wal_bytes(state_dir)

    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    auth.authenticate(raw, state_dir)
    raw.connect(state_dir.endpoint("writer"))

    def ask(*frames: bytes) -> protocol.Error:
        raw.send_multipart(list(frames))
        assert raw.poll(5000), "the writer did not answer"
        reply = protocol.decode(raw.recv())
        assert isinstance(reply, protocol.Error)
        return reply

    assert ask(b"\xc1garbage").code is protocol.ErrorCode.MALFORMED_FRAME
    assert ask(b"a", b"b").code is protocol.ErrorCode.MALFORMED_FRAME  # two frames
    unknown = ask(msgpack.packb({"v": 1, "kind": "launch_missiles", "msg_id": "m1"}))
    assert (unknown.code, unknown.msg_id) == (protocol.ErrorCode.UNKNOWN_KIND, "m1")
    assert ask(msgpack.packb({"v": 9, "kind": "ping", "msg_id": "m2"})).code is (
        protocol.ErrorCode.UNSUPPORTED_VERSION
    )
    deep: object = 1
    for _ in range(30):
        deep = [deep]
    assert ask(msgpack.packb({"v": 1, "kind": "ping", "msg_id": "m3", "x": deep})).code is (
        protocol.ErrorCode.TOO_DEEP
    )
    for bad_payload in (b"{not json", b'{"a":1}\n{"b":2}', b"NaN"):
        bad = protocol.Append(
            msg_id="m4", origin="o", key="bad", stream="agent/a", event="turn", payload=bad_payload
        )
        reply = ask(protocol.encode(bad))
        assert (reply.code, reply.msg_id) == (protocol.ErrorCode.INVALID_PAYLOAD, "m4")
    assert ask(protocol.encode(protocol.StopRequest(msg_id="m5"))).code is (
        protocol.ErrorCode.UNEXPECTED_MESSAGE
    )
    with pytest.raises(RemoteError) as info:
        client.append("agent/a", "turn", {"pad": "x" * 70_000}, key="huge")
    assert info.value.code in {"frame_too_large", "invalid_payload"}

    # over ZMQ_MAXMSGSIZE the transport drops the connection; the writer lives on
    raw.send(b"x" * 200_000)
    assert client.append("agent/a", "turn", {"ok": 2}, key="k2").seq == 2
    assert writer.poll() is None
    assert wal_bytes(state_dir).startswith(before)
    assert [r["key"] for r in wal_records(state_dir)] == ["k1", "k2"]
    raw.close(linger=0)
    client.close()


def test_writer_killed_while_clients_append_loses_nothing_acknowledged(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    journals = [state_dir.root.parent / f"journal-{i}.txt" for i in range(4)]
    clients = [
        processes.spawn(
            [
                "-m",
                "tests.appender",
                "--state-dir",
                str(state_dir.root),
                "--origin",
                f"c{i}",
                "--count",
                "150",
                "--journal",
                str(journal),
            ],
            name=f"appender-{i}",
        )
        for i, journal in enumerate(journals)
    ]
    for kill_round in range(2):
        wait_for(
            lambda n=kill_round: (
                sum(len(j.read_text().splitlines()) for j in journals if j.exists()) >= 60 * (n + 1)
            ),
            20,
            "clients to get appends acknowledged",
        )
        kill_and_reap(writer)
        writer = start_writer(processes, state_dir, ctx)
    for i, proc in enumerate(clients):
        assert proc.wait(timeout=40) == 0, processes.output(f"appender-{i}")

    records = wal_records(state_dir)
    seqs = [int(r["seq"]) for r in records]  # type: ignore[call-overload]
    assert seqs == list(range(1, len(records) + 1)), "seq must be gapless"
    by_key = {}
    for r in records:
        key = (r["origin"], r["key"])
        assert key not in by_key, f"{key} written twice"
        by_key[key] = r["seq"]
    for i, journal in enumerate(journals):
        acked = [line.split() for line in journal.read_text().splitlines()]
        assert len(acked) == 150
        for key, seq in acked:
            assert by_key[(f"c{i}", key)] == int(seq), f"acked c{i}/{key} at {seq} lost or moved"

    # a retry of an acknowledged key after the kills is answered with its seq
    with WriterClient(ctx, state_dir, "c0") as again:
        retry = again.append("agent/c0", "tool_call", {}, key="k5")
    assert retry.duplicate and retry.seq == by_key[("c0", "k5")]


def test_torn_tail_is_cut_at_start_and_logged_with_file_and_offset(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a", timeout_s=0.5, retries=20)
    for i in range(5):
        client.append("agent/a", "turn", {"i": i}, key=f"k{i}")
    kill_and_reap(writer)
    segment = list_segments(state_dir.wal_dir)[-1][1]
    size = segment.stat().st_size
    with open(segment, "ab") as f:
        f.write(b'{"seq":6,"ts":1.0,"stream":"agent/a","ev')  # a torn record
    start_writer(processes, state_dir, ctx)
    assert segment.stat().st_size == size
    log = [json.loads(line) for line in state_dir.log_path("writer").read_text().splitlines()]
    repaired = [e for e in log if e["event"] == "wal_tail_repaired"]
    assert repaired and repaired[0]["file"] == str(segment) and repaired[0]["offset"] == size
    assert client.append("agent/a", "turn", {"i": 5}, key="k5").seq == 6
    client.close()


def test_damage_before_the_tail_stops_the_writer_naming_file_and_offset(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a")
    for i in range(5):
        client.append("agent/a", "turn", {"i": i}, key=f"k{i}")
    client.close()
    writer.send_signal(signal.SIGTERM)
    writer.wait(timeout=10)
    # force a full scan: damage before a checkpoint is `wal verify`'s job, not start-up's
    state_dir.checkpoint_path.unlink()
    segment = list_segments(state_dir.wal_dir)[-1][1]
    data = bytearray(segment.read_bytes())
    second = data.index(b"\n") + 1
    data[second + 40] ^= 0x20
    segment.write_bytes(bytes(data))
    before = segment.read_bytes()
    proc = processes.spawn(
        ["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="writer2"
    )
    assert proc.wait(timeout=15) == EXIT_CORRUPT
    out = processes.output("writer2")
    assert str(segment) in out and f"byte {second}" in out
    assert segment.read_bytes() == before


def test_a_second_writer_on_the_same_state_dir_is_refused(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    first = start_writer(processes, state_dir, ctx)
    second = processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="w2")
    assert second.wait(timeout=15) == EXIT_LOCKED
    assert f"pid {first.pid}" in processes.output("w2")
    assert first.poll() is None


def test_failed_fdatasync_is_never_acknowledged_and_the_writer_exits(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx, env={FAULT_ENV_FAIL_SYNC_AT: "3"})
    client = WriterClient(ctx, state_dir, "agent-a", timeout_s=0.3, retries=0)
    assert client.append("agent/a", "turn", {}, key="k1").seq == 1
    assert client.append("agent/a", "turn", {}, key="k2").seq == 2
    with pytest.raises(RequestTimeoutError):
        client.append("agent/a", "turn", {}, key="k3")
    client.close()
    assert writer.wait(timeout=10) == EXIT_IO
    assert "fdatasync" in processes.output("writer")
    # the restart re-scans: k3 reached the file but was never acknowledged;
    # its retry is answered from the WAL rather than written twice
    start_writer(processes, state_dir, ctx)
    with WriterClient(ctx, state_dir, "agent-a") as again:
        retry = again.append("agent/a", "turn", {}, key="k3")
    assert retry.seq == 3
    assert [r["key"] for r in wal_records(state_dir)] == ["k1", "k2", "k3"]


def test_segments_rotate_and_a_stream_reads_across_them(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    writer = start_writer(processes, state_dir, ctx, "--segment-bytes", "4096")
    client = WriterClient(ctx, state_dir, "agent-a", timeout_s=0.5, retries=20)
    for i in range(60):
        client.append(f"agent/{i % 2}", "turn", {"i": i, "pad": "y" * 100}, key=f"k{i}")
    segments = list_segments(state_dir.wal_dir)
    assert len(segments) >= 3
    assert all(first == 1 or first > 1 for first, _ in segments)
    kill_and_reap(writer)
    start_writer(processes, state_dir, ctx, "--segment-bytes", "4096")
    client.append("agent/0", "turn", {"i": 60}, key="k60")
    assert [r.seq for r in client.read_stream("agent/0", page=7)] == list(range(1, 62, 2))
    client.close()


def test_ledger_appends_reach_their_ledger_files_in_wal_order(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    start_writer(processes, state_dir, ctx)
    client = WriterClient(ctx, state_dir, "agent-a")
    client.append("agent/a", "turn", {}, key="t1")
    b = client.append("agent/a", "budget", {"tokens": 10}, key="b1", ledger="budget")
    a = client.append("agent/a", "approval", {"op": "write_file"}, key="a1", ledger="approvals")
    budget = [json.loads(x) for x in state_dir.budget_ledger_path.read_text().splitlines()]
    approvals = [json.loads(x) for x in state_dir.approvals_ledger_path.read_text().splitlines()]
    assert [r["seq"] for r in budget] == [b.seq] and budget[0]["payload"] == {"tokens": 10}
    assert [r["seq"] for r in approvals] == [a.seq]
    client.close()


def test_run_dir_and_sockets_are_private(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    start_writer(processes, state_dir, ctx)
    assert stat.S_IMODE(state_dir.run_dir.stat().st_mode) == 0o700
    sock = Path(state_dir.endpoint("writer").removeprefix("ipc://"))
    assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0


def test_an_append_under_another_origin_has_its_own_window_and_journal(
    processes: ProcessTracker, state_dir: StateDir, ctx: zmq.Context[zmq.Socket[bytes]],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """procs appends each session's facts under the session's own origin: the
    same key under two origins is two records, the same key again under one
    origin is its first seq, and the soak's ack journal names each origin."""
    from ops.soakcheck import read_journal

    start_writer(processes, state_dir, ctx)
    journals = tmp_path / "acks"
    monkeypatch.setenv("CORRAL_ACK_JOURNAL_DIR", str(journals))
    with WriterClient(ctx, state_dir, "procs") as writer:
        a = writer.append("procs/a1", "proc_start", {"n": 1}, key="k", origin="procs/a1")
        b = writer.append("procs/a2", "proc_start", {"n": 2}, key="k", origin="procs/a2")
        again = writer.append("procs/a1", "proc_start", {"n": 1}, key="k", origin="procs/a1")
        assert a.seq != b.seq and (again.seq, again.duplicate) == (a.seq, True)
        origins = [r.origin for r in writer.read_stream("procs/a1")]
        assert origins == ["procs/a1"]
    assert read_journal(journals / "procs%a1.acks")[0][:2] == ("k", a.seq)
    assert read_journal(journals / "procs%a2.acks")[0][:2] == ("k", b.seq)
    assert not (journals / "procs.acks").exists()
