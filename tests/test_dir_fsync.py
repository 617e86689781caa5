"""Creating a ledger or a stream index file fsyncs its directory (as creating
a segment or a checkpoint does), so the new file's name survives a power loss
with the data already acknowledged or checkpointed in it; an existing file
costs no directory fsync."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.writer.ledgers import Ledgers
from actors.writer.streamindex import StreamIndex
from actors.writer.wal import encode_record
from broker import durable
from broker.statedir import StateDir


@pytest.fixture
def dir_syncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every directory fsynced, in order (the real fsync still happens)."""
    calls: list[Path] = []
    real = durable.fsync_dir

    def counting(path: Path) -> None:
        calls.append(Path(path))
        real(path)

    monkeypatch.setattr(durable, "fsync_dir", counting)
    return calls


def test_creating_a_ledger_fsyncs_its_directory_before_the_batch_is_durable(
    state_dir: StateDir, dir_syncs: list[Path]
) -> None:
    ledgers = Ledgers(
        {"budget": state_dir.budget_ledger_path, "approvals": state_dir.approvals_ledger_path}
    )
    ledgers.add("budget", encode_record(1, 1.0, "a", "budget", "o", "k1", "budget", b"1"))
    ledgers.commit()
    assert dir_syncs == [state_dir.budget_ledger_path.parent]
    ledgers.add("budget", encode_record(2, 1.0, "a", "budget", "o", "k2", "budget", b"2"))
    ledgers.add("approvals", encode_record(3, 1.0, "a", "ok", "o", "k3", "approvals", b"3"))
    ledgers.commit()
    parents = [state_dir.budget_ledger_path.parent, state_dir.approvals_ledger_path.parent]
    assert dir_syncs == parents
    ledgers.close()


def test_creating_stream_index_files_fsyncs_the_index_directory(
    state_dir: StateDir, dir_syncs: list[Path]
) -> None:
    index = StreamIndex(state_dir.stream_index_dir)
    index.add("agent/a", 1, 1, 0, 100)
    index.add("agent/b", 2, 1, 100, 100)
    assert index.flush(fsync=True) == []
    assert dir_syncs == [state_dir.stream_index_dir]  # once for the flush's new files
    index.add("agent/a", 3, 1, 200, 100)
    assert index.flush(fsync=True) == []
    assert dir_syncs == [state_dir.stream_index_dir]  # no new file, no directory fsync
    index.add("agent/c", 4, 1, 300, 100)
    index.flush(fsync=True)
    assert dir_syncs == [state_dir.stream_index_dir] * 2
    index.close()
