"""The writer's checkpoint with a short loop part (docs/wal.md, "Start-up";
actors/writer/checkpointsync.py): the loop only copies the idempotency windows
(`DedupeWindows.snapshot`) and takes the stream index's pending entries
(`StreamIndex.take_pending`); the checkpoint thread appends and fsyncs the
entries (`write_unsynced`) and encodes the checkpoint without pydantic
(`checkpoint.encode_fields`), byte for byte what the model wrote. Start-up's
objects are frozen out of the collector (`gcpolicy.settle`)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from actors.writer import checkpoint, gcpolicy
from actors.writer.dedupe import DedupeWindows, pairs
from actors.writer.streamindex import ENTRY, StreamIndex, stream_filename, write_unsynced


def _fields(dedupe: dict[str, list[tuple[str, int]]]) -> dict[str, object]:
    return dict(head_seq=812, segment_first_seq=1, offset=90_211, last_record_offset=89_900,
                dedupe=dedupe, index_counts={"agent/a": 500, "agent/é\"q": 312},
                ledger_sizes={"budget": 1_024, "approvals": 0},
                ledger_last_seq={"budget": 800}, storage_epoch=3)


def test_the_checkpoint_is_encoded_as_the_model_wrote_it_and_loads_back(tmp_path: Path) -> None:
    windows = DedupeWindows(window=4)
    for i in range(6):
        windows.remember("agent/a", f"k{i}", i + 1)
    windows.remember("svc\u00e9", "only", 9)
    fields = _fields(pairs(windows.snapshot()))
    data = checkpoint.encode_fields(fields)
    assert data == checkpoint.Checkpoint(**fields).model_dump_json().encode()  # type: ignore[arg-type]
    path = tmp_path / "wal.checkpoint.json"
    checkpoint.save_encoded(path, data)
    checkpoint.save_encoded(path, checkpoint.encode_fields({**fields, "head_seq": 813}))
    loaded, why = checkpoint.load(path)
    assert why is None and loaded is not None and loaded.head_seq == 813
    assert loaded.dedupe == {"agent/a": [("k2", 3), ("k3", 4), ("k4", 5), ("k5", 6)],
                             "svc\u00e9": [("only", 9)]}
    previous, _ = checkpoint.load(checkpoint.previous_path(path))
    assert previous is not None and previous.head_seq == 812


def test_a_checkpoint_with_a_missing_or_unknown_field_is_refused() -> None:
    fields = _fields({})
    with pytest.raises(ValueError, match="storage_epoch"):
        checkpoint.encode_fields({k: v for k, v in fields.items() if k != "storage_epoch"})
    with pytest.raises(ValueError, match="extra"):
        checkpoint.encode_fields({**fields, "extra": 1})


def test_a_windows_snapshot_is_a_copy_oldest_first_as_before() -> None:
    windows = DedupeWindows(window=3)
    for i in range(5):
        windows.remember("o", f"k{i}", i)
    windows.remember("o", "k3", 3)  # a key already there keeps its place
    snap = windows.snapshot()
    windows.remember("o", "k9", 9)  # after the snapshot: not in it
    assert pairs(snap) == {"o": [("k2", 2), ("k3", 3), ("k4", 4)]}
    assert windows.dump() == {"o": [("k3", 3), ("k4", 4), ("k9", 9)]}
    assert windows.lookup("o", "k2") is None and windows.lookup("o", "k9") == 9
    again = DedupeWindows.load(windows.dump(), 2)
    assert again.dump() == {"o": [("k4", 4), ("k9", 9)]}


def _file_entries(directory: Path, stream: str) -> int:
    path = directory / stream_filename(stream)
    return path.stat().st_size // ENTRY.size if path.exists() else 0


def test_taken_entries_are_written_by_the_thread_and_readable_meanwhile(tmp_path: Path) -> None:
    directory = tmp_path / "idx"
    index = StreamIndex(directory)
    for seq in (1, 2):
        index.add("s", seq, 1, seq * 100, 10)
    assert index.flush() == []
    index.add("s", 3, 1, 300, 10)
    index.add("t", 4, 1, 400, 10)
    failures, taken = index.take_pending()
    assert failures == []
    # the loop's part wrote nothing; the entries are still read from memory
    assert (_file_entries(directory, "s"), _file_entries(directory, "t")) == (2, 0)
    assert index.counts() == {"s": 2} and index.counts_with(taken) == {"s": 3, "t": 1}
    index.add("s", 5, 1, 500, 10)  # added while the thread writes
    assert [e[0] for e in index.lookup("s", 0, 10)] == [1, 2, 3, 5]
    assert [e[0] for e in index.lookup("s", 3, 1)] == [3]
    assert index.last_seq("s") == 5 and index.last_seq("t") == 4
    with pytest.raises(RuntimeError):
        index.take_pending()  # one checkpoint at a time
    with pytest.raises(RuntimeError):
        index.flush()  # no other change to the files meanwhile
    write_unsynced(directory, taken)  # the checkpoint thread's part
    assert taken.created and len(taken.paths) == 2
    assert (_file_entries(directory, "s"), _file_entries(directory, "t")) == (3, 1)
    index.commit(taken)
    assert index.counts() == {"s": 3, "t": 1}
    assert [e[0] for e in index.entries("s")] == [1, 2, 3, 5]
    assert index.flush() == [] and index.counts() == {"s": 4, "t": 1}
    index.close()


def test_entries_whose_write_failed_go_back_and_a_torn_file_is_cut(tmp_path: Path) -> None:
    directory = tmp_path / "idx"
    index = StreamIndex(directory)
    index.add("s", 1, 1, 100, 10)
    assert index.flush() == []
    index.add("s", 2, 1, 200, 10)
    _, taken = index.take_pending()
    with pytest.raises(OSError):
        write_unsynced(tmp_path / "gone", taken)  # the thread's write failed
    with (directory / stream_filename("s")).open("ab") as torn:
        torn.write(b"\x01" * 5)  # half an entry left by a write that failed part way
    index.add("s", 3, 1, 300, 10)
    index.revert(taken)
    assert index.counts() == {"s": 1}
    assert [e[0] for e in index.lookup("s", 0, 10)] == [1, 2, 3]
    _, again = index.take_pending()
    write_unsynced(directory, again)
    index.commit(again)
    assert index.counts() == {"s": 3} and _file_entries(directory, "s") == 3
    assert (directory / stream_filename("s")).stat().st_size == 3 * ENTRY.size
    assert [e[0] for e in index.entries("s")] == [1, 2, 3]
    index.close()


def test_settle_freezes_what_start_up_made() -> None:
    assert gc.get_freeze_count() == 0
    try:
        gcpolicy.settle()
        assert gc.get_freeze_count() > 1000  # the imported modules at least
        assert gc.isenabled()  # what serving makes is still collected
    finally:
        gc.unfreeze()
