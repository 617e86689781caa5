"""The WAL record format and start-up recovery on real files: a WAL cut at any
byte of its last records recovers to a clean prefix; a damaged record before
the tail is refused with its file and byte offset; a checkpoint bounds what
start-up scans; ledgers are completed from the WAL."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.writer import checkpoint
from actors.writer.ledgers import Ledgers
from actors.writer.payload import check_payload
from actors.writer.recovery import Recovered, recover
from actors.writer.wal import (
    TornTail,
    encode_record,
    iter_segment,
    list_segments,
    parse_record,
    segment_name,
)
from broker.errors import ProtocolError, WalCorruptionError, WalError
from broker.statedir import StateDir

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(
    seq=st.integers(1, 2**62),
    stream=st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,40}\Z"),
    key=st.from_regex(r"\A[A-Za-z0-9_.:/\-]{1,40}\Z"),
    ledger=st.sampled_from([None, "budget", "approvals"]),
    value=json_values,
)
@settings(max_examples=300, deadline=None)
def test_record_round_trips_and_is_plain_json(
    seq: int, stream: str, key: str, ledger: str | None, value: object
) -> None:
    payload = json.dumps(value, separators=(",", ":")).encode()
    check_payload(payload)
    line = encode_record(seq, 1.5, stream, "turn", "origin-1", key, ledger, payload)
    record = parse_record(line)
    assert record is not None
    assert (record.seq, record.stream, record.key, record.ledger) == (seq, stream, key, ledger)
    assert record.payload() == value
    as_json = json.loads(line)  # readable with jq: one JSON object per line
    assert as_json["seq"] == seq and as_json["payload"] == value
    assert line.count(b"\n") == 1


@pytest.mark.parametrize(
    "payload",
    [b"", b"{", b'{"a":1}\n', b"NaN", b'{"a":Infinity}', b"\xff\xfe", b"1 2", b'{"a":1}{"b":2}'],
)
def test_payloads_that_are_not_one_json_value_are_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        check_payload(payload)
    assert info.value.code == "invalid_payload"


def test_any_flipped_bit_makes_the_record_fail_its_check() -> None:
    line = encode_record(9, 2.0, "agent/a", "turn", "o", "k", None, b'{"x":[1,2,3]}')
    for i in range(len(line) - 1):  # every byte but the newline
        for bit in (0, 3, 7):
            damaged = bytearray(line)
            damaged[i] ^= 1 << bit
            assert parse_record(bytes(damaged)) is None, (i, bit)


# --- recovery on real files ----------------------------------------------------


def _write_wal(state_dir: StateDir, count: int, ledger_every: int = 0) -> list[int]:
    """Write `count` records into segment 1; return each record's start offset."""
    offsets = []
    path = state_dir.wal_dir / segment_name(1)
    with open(path, "wb") as f:
        for seq in range(1, count + 1):
            offsets.append(f.tell())
            ledger = "budget" if ledger_every and seq % ledger_every == 0 else None
            f.write(
                encode_record(
                    seq,
                    time.time(),
                    f"agent/a{seq % 3}",
                    "turn",
                    f"o{seq % 2}",
                    f"k{seq}",
                    ledger,
                    json.dumps({"n": seq}, separators=(",", ":")).encode(),
                )
            )
    return offsets


def _ledgers(state_dir: StateDir) -> Ledgers:
    return Ledgers(
        {"budget": state_dir.budget_ledger_path, "approvals": state_dir.approvals_ledger_path}
    )


def _records(state_dir: StateDir) -> list[int]:
    seqs = []
    for _, path in list_segments(state_dir.wal_dir):
        for _, item in iter_segment(path):
            assert not isinstance(item, TornTail)
            seqs.append(item.seq)
    return seqs


def test_cut_at_every_byte_of_the_last_three_records_recovers_a_clean_prefix(
    state_dir: StateDir,
) -> None:
    count = 6
    offsets = _write_wal(state_dir, count)
    path = state_dir.wal_dir / segment_name(1)
    pristine = path.read_bytes()
    for cut in range(offsets[count - 3], len(pristine) + 1):
        path.write_bytes(pristine[:cut])
        state_dir.checkpoint_path.unlink(missing_ok=True)
        ledgers = _ledgers(state_dir)
        rec = recover(state_dir, 64, ledgers)
        ledgers.close()
        rec.index.close()
        complete = sum(1 for off in offsets if off < cut and pristine[:cut].count(b"\n", off) >= 1)
        assert rec.head_seq == complete, cut
        assert _records(state_dir) == list(range(1, complete + 1)), cut
        assert (rec.repaired is not None) == (cut not in {*offsets, len(pristine)}), cut
        assert path.stat().st_size == ([*offsets, len(pristine)])[complete], cut


def test_flipped_bit_in_the_last_record_is_a_torn_tail_and_is_cut(state_dir: StateDir) -> None:
    offsets = _write_wal(state_dir, 5)
    path = state_dir.wal_dir / segment_name(1)
    data = bytearray(path.read_bytes())
    data[offsets[4] + 20] ^= 0x04
    path.write_bytes(bytes(data))
    rec = recover(state_dir, 64, _ledgers(state_dir))
    assert rec.head_seq == 4
    assert rec.repaired is not None and rec.repaired.offset == offsets[4]
    assert path.stat().st_size == offsets[4]


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_flipped_bit_before_the_tail_is_refused_with_file_and_offset(
    state_dir: StateDir, victim: int
) -> None:
    offsets = _write_wal(state_dir, 6)
    path = state_dir.wal_dir / segment_name(1)
    data = bytearray(path.read_bytes())
    data[offsets[victim] + 30] ^= 0x01
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    with pytest.raises(WalCorruptionError) as info:
        recover(state_dir, 64, _ledgers(state_dir))
    assert info.value.path == path
    assert info.value.offset == offsets[victim]
    assert path.read_bytes() == before  # nothing was cut or rewritten


def test_gap_in_seq_is_corruption(state_dir: StateDir) -> None:
    path = state_dir.wal_dir / segment_name(1)
    lines = [encode_record(s, 1.0, "s", "e", "o", f"k{s}", None, b"1") for s in (1, 2, 4, 5)]
    path.write_bytes(b"".join(lines))
    with pytest.raises(WalCorruptionError) as info:
        recover(state_dir, 64, _ledgers(state_dir))
    assert info.value.offset == len(lines[0]) + len(lines[1])
    assert "follows 2" in info.value.reason


def _save_checkpoint_of(state_dir: StateDir, rec: Recovered) -> None:
    rec.index.flush()
    checkpoint.save(
        state_dir.checkpoint_path,
        checkpoint.Checkpoint(
            head_seq=rec.head_seq,
            segment_first_seq=rec.head_segment_first_seq,
            offset=rec.head_end_offset,
            last_record_offset=rec.last_record_offset,
            dedupe=rec.dedupe.dump(),
            index_counts=rec.index.counts(),
            ledger_sizes=_ledgers(state_dir).sizes(),
            ledger_last_seq=rec.ledger_last_seq,
        ),
    )
    rec.index.close()


def test_checkpoint_bounds_the_scan_and_matches_a_full_scan(state_dir: StateDir) -> None:
    _write_wal(state_dir, 50)
    full = recover(state_dir, 8, _ledgers(state_dir))
    assert full.full_scan and full.scanned_records == 50
    _save_checkpoint_of(state_dir, full)
    path = state_dir.wal_dir / segment_name(1)
    with open(path, "ab") as f:
        for seq in range(51, 56):
            f.write(encode_record(seq, 1.0, "agent/a1", "turn", "o1", f"k{seq}", None, b"{}"))
    tail = recover(state_dir, 8, _ledgers(state_dir))
    assert not tail.full_scan
    assert tail.scanned_records == 5
    assert tail.head_seq == 55
    assert tail.dedupe.lookup("o1", "k55") == 55
    assert tail.dedupe.lookup("o0", "k50") == 50  # from the checkpoint
    assert [e[0] for e in tail.index.lookup("agent/a1", 40, 100)] == [
        40,
        43,
        46,
        49,
        51,
        52,
        53,
        54,
        55,
    ]


def test_a_checkpoint_that_disagrees_with_the_wal_is_ignored_not_trusted(
    state_dir: StateDir,
) -> None:
    _write_wal(state_dir, 10)
    checkpoint.save(
        state_dir.checkpoint_path,
        checkpoint.Checkpoint(
            head_seq=7,
            segment_first_seq=1,
            offset=123,
            last_record_offset=5,
            dedupe={},
            index_counts={},
        ),
    )
    rec = recover(state_dir, 8, _ledgers(state_dir))
    assert rec.full_scan and rec.head_seq == 10
    assert rec.checkpoint_note is not None
    assert rec.checkpoint_note.startswith("wal.checkpoint.json ignored")


def test_a_tail_lost_past_the_newest_checkpoint_starts_from_the_previous_one(
    state_dir: StateDir,
) -> None:
    offsets = _write_wal(state_dir, 30)
    path = state_dir.wal_dir / segment_name(1)
    pristine = path.read_bytes()
    path.write_bytes(pristine[: offsets[20]])  # the WAL as it was at seq 20
    _save_checkpoint_of(state_dir, recover(state_dir, 8, _ledgers(state_dir)))
    path.write_bytes(pristine)  # then it grew to 30 and was checkpointed again
    _save_checkpoint_of(state_dir, recover(state_dir, 8, _ledgers(state_dir)))
    path.write_bytes(pristine[: offsets[25] + 7])  # and lost its tail past seq 25
    rec = recover(state_dir, 8, _ledgers(state_dir))
    assert not rec.full_scan  # the previous checkpoint (seq 20) was used
    assert rec.scanned_records == 5
    assert rec.head_seq == 25
    assert rec.repaired is not None and rec.repaired.offset == offsets[25]
    assert rec.checkpoint_note is not None and "wal.checkpoint.json ignored" in rec.checkpoint_note
    assert [e[0] for e in rec.index.lookup("agent/a1", 1, 100)] == [1, 4, 7, 10, 13, 16, 19, 22, 25]
    assert rec.dedupe.lookup("o0", "k28") is None  # keys of the lost records are forgotten
    assert rec.dedupe.lookup("o1", "k25") == 25


def test_checkpoint_without_any_segment_is_refused(state_dir: StateDir) -> None:
    checkpoint.save(
        state_dir.checkpoint_path,
        checkpoint.Checkpoint(
            head_seq=7,
            segment_first_seq=1,
            offset=700,
            last_record_offset=600,
            dedupe={},
            index_counts={},
        ),
    )
    with pytest.raises(WalError, match="holds no segment"):
        recover(state_dir, 8, _ledgers(state_dir))


def test_torn_record_in_a_sealed_segment_is_corruption(state_dir: StateDir) -> None:
    first = state_dir.wal_dir / segment_name(1)
    second = state_dir.wal_dir / segment_name(3)
    first.write_bytes(
        encode_record(1, 1.0, "s", "e", "o", "k1", None, b"1")
        + encode_record(2, 1.0, "s", "e", "o", "k2", None, b"2")[:-5]
    )
    second.write_bytes(encode_record(3, 1.0, "s", "e", "o", "k3", None, b"3"))
    with pytest.raises(WalCorruptionError) as info:
        recover(state_dir, 8, _ledgers(state_dir))
    assert info.value.path == first


def test_ledger_missing_its_last_records_is_completed_from_the_wal(state_dir: StateDir) -> None:
    _write_wal(state_dir, 20, ledger_every=4)  # seqs 4, 8, 12, 16, 20 are budget records
    wal_lines = {
        r.seq: r.line
        for _, r in iter_segment(state_dir.wal_dir / segment_name(1))  # type: ignore[union-attr]
    }
    # the ledger got 4 and 8 fully, 12 torn (a crash between the WAL sync and the ledger's)
    state_dir.budget_ledger_path.write_bytes(wal_lines[4] + wal_lines[8] + wal_lines[12][:17])
    ledgers = _ledgers(state_dir)
    rec = recover(state_dir, 8, ledgers)
    ledgers.close()
    assert rec.ledger_appends["budget"] == 3
    lines = state_dir.budget_ledger_path.read_bytes().splitlines(keepends=True)
    assert lines == [wal_lines[s] for s in (4, 8, 12, 16, 20)]


def test_recovering_twice_changes_nothing(state_dir: StateDir) -> None:
    _write_wal(state_dir, 30, ledger_every=5)
    first = recover(state_dir, 8, _ledgers(state_dir))
    first.index.close()
    snapshot = {p.name: p.read_bytes() for p in state_dir.wal_dir.iterdir()}
    second = recover(state_dir, 8, _ledgers(state_dir))
    assert second.head_seq == first.head_seq == 30
    assert {p.name: p.read_bytes() for p in state_dir.wal_dir.iterdir()} == snapshot
    assert os.path.getsize(state_dir.budget_ledger_path) > 0


def test_ledger_ahead_of_a_wal_that_lost_its_tail_is_cut_back_to_it(state_dir: StateDir) -> None:
    offsets = _write_wal(state_dir, 20, ledger_every=4)
    path = state_dir.wal_dir / segment_name(1)
    wal_lines = {r.seq: r.line for _, r in iter_segment(path)}  # type: ignore[union-attr]
    state_dir.budget_ledger_path.write_bytes(b"".join(wal_lines[s] for s in (4, 8, 12, 16, 20)))
    path.write_bytes(path.read_bytes()[: offsets[13]])  # the WAL now ends at seq 13
    rec = recover(state_dir, 8, _ledgers(state_dir))
    assert rec.head_seq == 13
    assert rec.ledger_dropped == {"budget": 2}
    assert state_dir.budget_ledger_path.read_bytes() == wal_lines[4] + wal_lines[8] + wal_lines[12]


def test_a_ledger_missing_records_from_before_the_checkpoint_is_completed_from_the_wal(
    state_dir: StateDir,
) -> None:
    """Completion does not stop at the checkpoint: the checkpoint says which
    ledger seq the WAL held last, and a ledger that ends earlier is completed
    from the WAL's acknowledged part too."""
    _write_wal(state_dir, 30, ledger_every=3)
    _save_checkpoint_of(state_dir, recover(state_dir, 8, _ledgers(state_dir)))
    complete = state_dir.budget_ledger_path.read_bytes()
    lines = complete.splitlines(keepends=True)
    assert len(lines) == 10
    state_dir.budget_ledger_path.write_bytes(b"".join(lines[:3]))  # lost seqs 12..30
    rec = recover(state_dir, 8, _ledgers(state_dir))
    assert not rec.full_scan and rec.scanned_records == 0
    assert rec.ledger_appends["budget"] == 7
    assert state_dir.budget_ledger_path.read_bytes() == complete
    assert rec.ledger_last_seq["budget"] == 30


def test_a_ledger_in_step_with_the_checkpoint_is_checked_only_past_it(
    state_dir: StateDir,
) -> None:
    """The start-up cost of the ledger check does not grow with the ledger:
    lines before the checkpointed size are not read again."""
    _write_wal(state_dir, 30, ledger_every=3)
    _save_checkpoint_of(state_dir, recover(state_dir, 8, _ledgers(state_dir)))
    data = bytearray(state_dir.budget_ledger_path.read_bytes())
    data[10] ^= 0x01  # damage before the checkpointed size: wal verify's job, not start-up's
    state_dir.budget_ledger_path.write_bytes(bytes(data))
    rec = recover(state_dir, 8, _ledgers(state_dir))
    assert rec.ledger_repairs == [] and rec.ledger_appends["budget"] == 0
