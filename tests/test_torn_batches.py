"""Power loss in the middle of a group-commit batch, on real files: whatever
shape the torn final batch has (sectors missing as zeros, later sectors
present, the file short of or past the data), start-up keeps every
acknowledged record, cuts the torn batch and nothing else, and the WAL ends at
a batch boundary; damage inside an acknowledged batch (one a later batch
follows) is refused with the file and the offset of the first bad line."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.writer.ledgers import Ledgers
from actors.writer.recovery import recover
from actors.writer.wal import parse_record, segment_name
from broker.errors import WalCorruptionError
from broker.statedir import StateDir
from tests.tornwrite import Shape, batch_lines, sectors_of, tear

FIXTURE = HealthCheck.function_scoped_fixture  # state_dir is emptied by _fresh per example


def _ledgers(state_dir: StateDir) -> Ledgers:
    return Ledgers(
        {"budget": state_dir.budget_ledger_path, "approvals": state_dir.approvals_ledger_path}
    )


def _acked(sizes: list[int], pad: int) -> list[list[bytes]]:
    batches, seq = [], 1
    for size in sizes:
        batches.append(batch_lines(seq, size, pad=pad, ledger_every=3))
        seq += size
    return batches


def _fresh(state_dir: StateDir) -> None:
    for path in [*state_dir.wal_dir.iterdir(), state_dir.budget_ledger_path,
                 state_dir.checkpoint_path]:
        path.unlink(missing_ok=True)


@st.composite
def torn_cases(draw: st.DrawFn) -> tuple[list[int], int, int, Shape]:
    sizes = draw(st.lists(st.integers(1, 5), min_size=0, max_size=6))
    pad = draw(st.integers(0, 300))
    final = draw(st.integers(1, 12))
    present = draw(st.frozensets(st.integers(0, 40)))
    size = draw(st.sampled_from(["exact", "short", "past"]))
    return sizes, pad, final, Shape(present, size, draw(st.integers(1, 9000)))


@given(case=torn_cases())
@settings(max_examples=100, deadline=None, suppress_health_check=[FIXTURE])
def test_any_torn_final_batch_is_cut_and_every_acknowledged_record_kept(
    state_dir: StateDir, case: tuple[list[int], int, int, Shape]
) -> None:
    sizes, pad, final, shape = case
    _fresh(state_dir)
    batches = _acked(sizes, pad)
    acked = b"".join(b"".join(b) for b in batches)
    acked_head = sum(sizes)
    path = state_dir.wal_dir / segment_name(1)
    path.write_bytes(acked)
    budget = [ln for b in batches for ln in b if b'"ledger":"budget"' in ln]
    state_dir.budget_ledger_path.write_bytes(b"".join(budget))
    torn = b"".join(batch_lines(acked_head + 1, final, pad=pad, ledger_every=3))
    tear(path, torn, shape)
    on_disk = path.stat().st_size
    whole = all(i in shape.present for i in range(len(sectors_of(len(acked), len(torn)))))

    ledgers = _ledgers(state_dir)
    rec = recover(state_dir, 64, ledgers)  # never raises: nothing acknowledged is damaged
    ledgers.close()
    rec.index.close()

    kept = acked + torn if whole else acked
    assert path.read_bytes() == kept
    assert rec.head_seq == (acked_head + final if whole else acked_head)
    if whole:  # only zeros past the data, if any, are cut
        assert (rec.repaired is not None) == (shape.size == "past")
    elif on_disk > len(acked):  # the whole torn batch is cut, from its start
        assert rec.repaired is not None and rec.repaired.offset == len(acked)
        assert rec.repaired.first_seq == acked_head + 1
        assert rec.repaired.size == on_disk - len(acked)
    else:
        assert rec.repaired is None  # nothing of it reached the disk
    # the ledger holds exactly the budget records of what was kept
    kept_budget = [ln for ln in kept.splitlines(keepends=True) if b'"ledger":"budget"' in ln]
    assert state_dir.budget_ledger_path.read_bytes() == b"".join(kept_budget)


@given(
    sizes=st.lists(st.integers(1, 5), min_size=2, max_size=6),
    pad=st.integers(0, 300),
    line_pick=st.integers(0, 10**6),
    into=st.integers(0, 10**6),
    length=st.integers(1, 512),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[FIXTURE])
def test_damage_inside_an_acknowledged_batch_is_refused_at_its_first_bad_line(  # noqa: PLR0917
    state_dir: StateDir, sizes: list[int], pad: int, line_pick: int, into: int, length: int
) -> None:
    _fresh(state_dir)
    batches = _acked(sizes, pad)
    data = b"".join(b"".join(b) for b in batches)
    last_batch_start = len(data) - len(b"".join(batches[-1]))
    # damage anywhere before the last batch, which stays whole: its records
    # prove that every batch before it was acknowledged
    spans, off = [], 0
    for line in data.splitlines(keepends=True):
        spans.append((off, off + len(line)))
        off += len(line)
    eligible = [(s, e) for s, e in spans if s < last_batch_start]
    s, e = eligible[line_pick % len(eligible)]
    a = s + into % (e - s - 1)  # from a byte of this line before its newline
    b = min(a + length, last_batch_start - 1)  # the newline before the last batch stays
    bad = bytearray(data)
    bad[a:b] = bytes(b - a)
    path = state_dir.wal_dir / segment_name(1)
    path.write_bytes(bytes(bad))
    with pytest.raises(WalCorruptionError) as info:
        recover(state_dir, 64, _ledgers(state_dir))
    assert (info.value.path, info.value.offset) == (path, s)  # the line holding the first zero
    assert path.read_bytes() == bytes(bad)  # nothing cut


def test_a_later_part_of_the_final_batch_without_its_start_is_cut_whole(
    state_dir: StateDir,
) -> None:
    """The issue's shape: zeros, the end of a record, then more whole records
    of the same batch: not damage before the tail, a torn batch."""
    batches = _acked([2, 3, 1], 120)
    acked = b"".join(b"".join(b) for b in batches)
    path = state_dir.wal_dir / segment_name(1)
    path.write_bytes(acked)
    torn = b"".join(batch_lines(7, 9, pad=120))
    count = len(sectors_of(len(acked), len(torn)))
    tear(path, torn, Shape(frozenset(range(1, count)), "past", 3000))
    data = path.read_bytes()
    torn_lines = data[len(acked):].splitlines(keepends=True)
    assert data[len(acked)] == 0 and parse_record(torn_lines[0]) is None  # zeros + a record's end
    assert sum(parse_record(ln) is not None for ln in torn_lines) >= 5  # then whole records
    rec = recover(state_dir, 64, _ledgers(state_dir))
    assert rec.head_seq == 6
    assert rec.repaired is not None
    assert (rec.repaired.offset, rec.repaired.bad_offset) == (len(acked), len(acked))
    assert rec.repaired.size == len(data) - len(acked)
    assert path.read_bytes() == acked


def test_a_batch_cut_short_by_the_end_of_the_file_is_cut_from_its_start(
    state_dir: StateDir,
) -> None:
    """Whole records of the final batch without its last ones: none of them
    was acknowledged (the batch is acked only after its fdatasync), and keeping
    a partial batch would confuse the next start: it is cut from its start."""
    acked = b"".join(b"".join(b) for b in _acked([3], 10))
    path = state_dir.wal_dir / segment_name(1)
    final = batch_lines(4, 5, pad=10)
    path.write_bytes(acked + b"".join(final[:3]))
    rec = recover(state_dir, 64, _ledgers(state_dir))
    assert rec.head_seq == 3 and path.read_bytes() == acked
    assert rec.repaired is not None and rec.repaired.first_seq == 4


def test_a_later_batch_after_damage_in_the_final_segment_proves_it_acknowledged(
    state_dir: StateDir,
) -> None:
    acked = _acked([2, 2], 10)
    path = state_dir.wal_dir / segment_name(1)
    first = b"".join(acked[0])
    damaged = bytearray(b"".join(acked[1]))
    damaged[5:20] = bytes(15)
    later = b"".join(batch_lines(5, 2, pad=10))
    path.write_bytes(first + bytes(damaged) + later)
    with pytest.raises(WalCorruptionError) as info:
        recover(state_dir, 64, _ledgers(state_dir))
    assert info.value.offset == len(first)
    assert "later batch" in info.value.reason
