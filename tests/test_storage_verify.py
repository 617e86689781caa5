"""`supervisor wal verify` and the writer's start-up plan tell a WAL truncated
or compacted on purpose (recorded in `state/wal.retention.json`) from one that
lost records (docs/storage.md): the same missing seqs are sound with the
record and a gap without it. In-process, no writer."""

from __future__ import annotations

from actors.writer import retention
from actors.writer.recovery import plan
from actors.writer.wal import encode_record, segment_name
from broker.statedir import StateDir
from supervisor.walverify import verify


def _write(state_dir: StateDir, seqs: list[int], first: int, batch: tuple[int, int]) -> None:
    lines = [encode_record(s, 1.0, "agent/a", "turn", "o", f"k{s}", None, b"{}", batch)
             for s in seqs]
    (state_dir.wal_dir / segment_name(first)).write_bytes(b"".join(lines))


def _wal_with_holes(state_dir: StateDir) -> None:
    """Segments 11.. and 21..: seqs 1-10 truncated; 13-14 (the middle of
    batch 11-15), 20 (the end of batch 16-20) and 21 (the start of batch
    21-25, the segment's named first seq) compacted."""
    _write(state_dir, [11, 12], 11, (11, 15))
    with open(state_dir.wal_dir / segment_name(11), "ab") as f:
        f.write(b"".join(encode_record(s, 1.0, "agent/a", "turn", "o", f"k{s}", None, b"{}",
                                       (11, 15)) for s in (15,)))
        f.write(b"".join(encode_record(s, 1.0, "agent/a", "turn", "o", f"k{s}", None, b"{}",
                                       (16, 20)) for s in (16, 17, 18, 19)))
    _write(state_dir, [22, 23, 24, 25], 21, (21, 25))


def test_truncated_and_compacted_seqs_are_not_gaps_when_recorded(state_dir: StateDir) -> None:
    _wal_with_holes(state_dir)
    retention.save(retention.path_in(state_dir.state_dir), retention.RetentionState(
        floor_seq=11, epoch=2, compacted=[(13, 14), (20, 21)]))
    report = verify(state_dir)
    assert report.sound, report
    assert (report.floor_seq, report.compacted_missing, report.head_seq) == (11, 4, 25)
    assert plan(state_dir).head_seq == 25  # the writer starts, from the floor


def test_the_same_holes_without_the_record_are_reported(state_dir: StateDir) -> None:
    _wal_with_holes(state_dir)
    report = verify(state_dir)
    assert not report.sound
    assert report.gaps[0] == (0, 11)  # the WAL starts above seq 1 with no floor recorded
    assert report.writer_refuses  # start-up refuses it (exit 65) like any loss


def test_a_gap_outside_the_recorded_ranges_is_still_a_gap(state_dir: StateDir) -> None:
    _wal_with_holes(state_dir)
    retention.save(retention.path_in(state_dir.state_dir), retention.RetentionState(
        floor_seq=11, epoch=2, compacted=[(13, 14), (21, 21)]))  # 20 not recorded
    report = verify(state_dir)
    assert not report.sound and report.writer_refuses
