"""The effect journal (actors/kernel/effects.py): one session's entries in
memory and in its journal file, appended through a kept fd; read back by a
restarted process, whatever a crash tore; pruned by turn and by session; the
earlier layout (a file per entry) still read; a purge finds the session's
journal by its name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from actors.agent.loop import Step
from actors.kernel.effects import (
    KEEP_TURNS,
    PRUNE_EVERY,
    EffectJournal,
    Entry,
    file_name,
    journal_name,
    session_of_file,
)
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, write_task
from tests.test_trees_rewind import drive, start

pytestmark = pytest.mark.timeout(60)  # a fifo waited on would hang

S1, S2 = "01J0000000000000000000000A", "01J0000000000000000000000B"


def entry(call_id: str, after: str = "a") -> Entry:
    return Entry(call_id, "act", f"out/{call_id}.txt", None, after, {"bytes": 1})


def test_entries_are_read_back_by_a_restarted_process_in_their_own_session(
        tmp_path: Path) -> None:
    journal = EffectJournal(tmp_path)
    journal.record(entry("1.0"), S1)
    journal.record(entry("2.0"), S1)
    journal.record(entry("1.0", after="b"), S1)  # recorded again: the last line wins
    assert journal.get("1.0", S1) == entry("1.0", after="b")
    assert journal.get("1.0", S2) is None  # another session's call 1.0 is another call
    del journal
    again = EffectJournal(tmp_path)
    assert again.get("1.0", S1) == entry("1.0", after="b")
    assert again.get("2.0", S1) == entry("2.0")
    assert again.get("3.0", S1) is None
    assert sorted(p.name for p in (tmp_path / "effects").iterdir()) == [journal_name(S1)]


def test_a_line_reads_back_whatever_its_text_holds(tmp_path: Path) -> None:
    """Lines are orjson's (UTF-8, compact) and json's where orjson declines (a
    lone surrogate, an integer past 64 bits): all read back as recorded."""
    odd = [
        Entry("1.0", "act", "out/ü 名.txt", None, "a", {"bytes": 1, "note": "é\n\"q\""}),
        Entry("2.0", "act", "out/\udc80.txt", "b", None, {"bytes": 2}),  # a lone surrogate
        Entry("3.0", "act", "out/big.txt", None, None, {"bytes": 2**70, "x": [1.5, -0.0]}),
    ]
    journal = EffectJournal(tmp_path)
    for e in odd:
        journal.record(e, S1)
    del journal
    again = EffectJournal(tmp_path)
    for e in odd:
        assert again.get(e.call_id, S1) == e
    lines = (tmp_path / "effects" / journal_name(S1)).read_bytes().splitlines()
    assert "ü 名".encode() in lines[0] and b", " not in lines[0]  # orjson's: UTF-8, compact


def test_a_line_a_crash_tore_is_skipped_and_the_next_starts_on_its_own(tmp_path: Path) -> None:
    journal = EffectJournal(tmp_path)
    journal.record(entry("1.0"), S1)
    del journal
    path = tmp_path / "effects" / journal_name(S1)
    whole = json.dumps(entry("2.0").__dict__, separators=(",", ":")).encode()
    with open(path, "ab") as f:
        f.write(whole[: len(whole) // 2])  # killed midway through a write
    restarted = EffectJournal(tmp_path)
    assert restarted.get("2.0", S1) is None  # whole or absent
    restarted.record(entry("3.0"), S1)
    del restarted
    third = EffectJournal(tmp_path)
    assert third.get("1.0", S1) == entry("1.0")
    assert third.get("3.0", S1) == entry("3.0")  # not glued to the torn line


def test_prune_drops_old_turns_rewrites_the_journal_and_removes_other_sessions(
        tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    effects.mkdir()
    # the earlier layout: a file per entry, this session's and another's
    (effects / file_name("1.1", S1)).write_text(json.dumps(entry("1.1").__dict__))
    (effects / file_name("1.1", S2)).write_text(json.dumps(entry("1.1").__dict__))
    (effects / journal_name(S2)).write_text(json.dumps(entry("5.0").__dict__) + "\n")
    journal = EffectJournal(tmp_path)
    assert journal.get("1.1", S1) == entry("1.1")  # read from the earlier layout
    last = 3 * KEEP_TURNS
    for turn in range(1, last + 1):
        journal.record(entry(f"{turn}.0"), S1)
        journal.prune(turn, S1)
    assert sorted(p.name for p in effects.iterdir()) == [journal_name(S1)]
    kept = [int(c.split(".")[0]) for c in journal._entries]
    assert min(kept) >= last - KEEP_TURNS - PRUNE_EVERY and max(kept) == last
    lines = (effects / journal_name(S1)).read_bytes().splitlines()
    assert len(lines) <= 2 * len(kept) + PRUNE_EVERY  # rewritten, not grown with history
    del journal
    again = EffectJournal(tmp_path)
    assert again.get(f"{last}.0", S1) == entry(f"{last}.0")
    assert again.get("1.0", S1) is None and again.get("1.1", S1) is None


def test_purge_finds_a_sessions_journal_and_entry_files_by_name() -> None:
    assert session_of_file(journal_name(S1)) == S1
    assert session_of_file(journal_name(S1) + ".tmp") == S1
    assert session_of_file(file_name("3.1", S1)) == S1
    assert session_of_file(file_name("3.1", S1) + ".tmp") == S1
    assert session_of_file(journal_name(None)) is None
    assert session_of_file(file_name("3.1", None)) is None


EDIT_STEPS = [
    {"op": "write_file", "path": "a.txt", "content": "one\n"},
    {"op": "edit_file", "path": "a.txt", "old": "one", "new": "one+two"},
    {"op": "finish", "summary": "done"},
]


def test_a_write_the_wal_lost_is_not_applied_again_by_a_restarted_agent(
        state_dir: StateDir, tmp_path: Path) -> None:
    """What the journal is for: a disk that lost an acknowledged tail (from the
    edit's `tool_start` on). The restarted agent, a new loop reading the
    journal from disk, plans the same edit again; its target already holds
    the after-digest, so it is recorded with the noted result, not applied
    a second time (which would give "one+two+two")."""
    writer = FakeWriter()
    loop = start(state_dir, writer, "a1", write_task(tmp_path / "t.yaml", EDIT_STEPS))
    assert drive(loop) is Step.DONE
    target = loop.workspace / "a.txt"
    assert target.read_text() == "one+two\n"
    cut = next(i for i, r in enumerate(writer.records) if r.event == "tool_start"
               and isinstance(p := r.payload(), dict) and p.get("op") == "edit_file")
    lost = {r.seq for r in writer.records[cut:]}
    del writer.records[cut:]
    for key in [k for k, seq in writer.keys.items() if seq in lost]:
        del writer.keys[key]
    restarted = start(state_dir, writer, "a1")
    assert drive(restarted) is Step.DONE
    assert target.read_text() == "one+two\n"
    edits = [p for e, p in writer.events("agent/a1")
             if e == "tool_result" and isinstance(p, dict) and p.get("op") == "edit_file"]
    assert [p["status"] for p in edits] == ["ok"]


def test_a_link_or_a_fifo_at_the_journals_name_is_never_read_or_written_through(
        tmp_path: Path) -> None:
    """Hostile files where the journal goes: a link to a file holding a forged
    entry (one that would make the agent skip a write) is not read, and the
    next entry replaces the link, the file it named untouched; a fifo is
    neither waited on nor written to; lines that are not entries are skipped."""
    effects = tmp_path / "effects"
    effects.mkdir()
    outside = tmp_path / "outside.jsonl"
    forged = json.dumps(entry("7.0", after="forged").__dict__) + "\n"
    outside.write_text(forged)
    (effects / journal_name(S1)).symlink_to(outside)
    (effects / journal_name(S2)).write_bytes(
        b'not json\n[1,2]\n{"call_id":"x"}\n\xff\xfe\n' + json.dumps(entry("3.0").__dict__).encode()
        + b"\n")
    os.mkfifo(effects / journal_name(None))
    journal = EffectJournal(tmp_path)
    assert journal.get("7.0", S1) is None
    journal.record(entry("8.0"), S1)
    assert outside.read_text() == forged
    assert not (effects / journal_name(S1)).is_symlink()
    assert EffectJournal(tmp_path).get("8.0", S1) == entry("8.0")
    assert journal.get("3.0", S2) == entry("3.0")  # the good line among the garbage
    assert journal.get("1.0", None) is None  # the fifo: not waited on
    journal.record(entry("1.0"), None)
    assert EffectJournal(tmp_path).get("1.0", None) == entry("1.0")
