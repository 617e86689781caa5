"""Sessions, time travel and storage as a user drives them (docs/sessions.md,
docs/trees.md, docs/storage.md, docs/supervisor.md "Trace"): a detached
`supervisor up`, three scripted agents spawned from a task file, then trace,
the session index commands, rewind and run on, fork and start the fork, purge,
du, gc and `wal verify`. One runtime for the module; each test works on
agents of its own, or only reads."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.acceptance.conftest import Corral, Result, writer_task

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

WRITER_TASK = writer_task(4)
AGENTS = ("n1", "rw", "pg")
ALL_FILES = ["a0.txt", "a1.txt", "a2.txt", "a3.txt"]


@pytest.fixture(scope="module")
def runtime(module_corral: Corral) -> tuple[Corral, Result]:
    corral = module_corral
    detached = corral.run("up", "--detach", timeout_s=90)
    corral.wait_running(timeout_s=90)
    corral.write("writer.yaml", WRITER_TASK)
    for name in AGENTS:
        corral.run("spawn", name, "--task", "writer.yaml")
    for name in AGENTS:  # a finished agent exits 0 (status is the cheap thing to poll)
        assert corral.wait_state(name, {"exited", "fatal"})["last_exit"] == "exit 0"
    assert {r["agent"]: r["status"] for r in corral.sessions()} == dict.fromkeys(
        AGENTS, "finished")
    return corral, detached


def workspace(corral: Corral, agent: str) -> list[str]:
    return sorted(p.name for p in (corral.state_dir / "agents" / agent / "workspace").iterdir())


def session_id(corral: Corral, agent: str) -> str:
    sid: str = corral.sessions(agent)[-1]["session_id"]
    return sid


def test_detached_up_returns_once_its_status_is_published(
        runtime: tuple[Corral, Result]) -> None:
    corral, detached = runtime
    started = re.search(r"started, pid (\d+)", detached.stdout + detached.stderr)
    assert started is not None, detached
    assert corral.status()["supervisor_pid"] == int(started.group(1))
    assert (corral.state_dir / "logs" / "supervisor.out").is_file()
    written = json.loads((corral.state_dir / "run" / "status.json").read_text())
    assert written["supervisor_pid"] == int(started.group(1))


def test_trace_shows_an_agents_session(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    sid = session_id(corral, "n1")
    text = corral.run("trace", "n1").stdout
    assert f"SESSION {sid}" in text
    assert 'write_file(path="a3.txt"' in text or "a3.txt" in text
    assert text.count("write_file OK") == 4
    assert "session exit: finished" in text
    records = [json.loads(line) for line in corral.run("trace", "n1", "--json").stdout.splitlines()]
    assert all({"seq", "ts", "stream", "event", "origin", "payload"} <= set(r) for r in records)
    assert {r["stream"] for r in records} == {"agent/n1"}
    assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)
    assert records[-1]["event"] == "session_exit"
    since = records[len(records) // 2]["seq"]
    later = corral.run("trace", "n1", "--json", "--since", str(since)).stdout.splitlines()
    assert [json.loads(line)["seq"] for line in later] == [r["seq"] for r in records
                                                          if r["seq"] >= since]
    missing = corral.run("trace", "nosuch", rc=1)
    assert "nosuch" in missing.stderr


def test_sessions_list_and_show(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    rows = {r["agent"]: r for r in corral.json("sessions", "list")}
    assert set(AGENTS) <= set(rows)
    row = rows["n1"]
    assert row["status"] == "finished" and row["exit_reason"] == "finished"
    # four writes, then the scripted model's `finish` past the end of its steps
    assert row["turns"] == 5 and row["tool_calls"] == 5 and row["stream"] == "agent/n1"
    assert re.fullmatch(r"[0-9A-HJKMNP-TV-Z]{26}", row["session_id"])
    table = corral.run("sessions", "list").stdout
    assert row["session_id"] in table and "finished" in table
    # a unique start of the id: ids of sessions begun within the same quarter
    # second share their first 8 characters (48 bits of milliseconds lead)
    others = [r["session_id"] for r in corral.json("sessions", "list", "--all")
              if r["session_id"] != row["session_id"]]
    size = next(n for n in range(8, 27)
                if not any(o.startswith(row["session_id"][:n]) for o in others))
    shown = corral.run("sessions", "show", row["session_id"][:size]).stdout
    assert re.search(rf"session_id\s+{row['session_id']}", shown)
    assert re.search(r"status\s+finished", shown)
    only = corral.json("sessions", "list", "--agent", "n1")
    assert [r["session_id"] for r in only] == [row["session_id"]]
    by_agent = corral.json("sessions", "show", "n1")
    assert by_agent["session_id"] == row["session_id"] and by_agent["agent"] == "n1"
    corral.run("sessions", "show", "nosuch", rc=1)


def test_label_archive_unarchive(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    sid = session_id(corral, "n1")
    corral.run("sessions", "label", "n1", "release-candidate")
    labelled = corral.json("sessions", "list", "--label", "release-candidate")
    assert [r["session_id"] for r in labelled] == [sid]
    corral.run("sessions", "archive", sid)
    assert sid not in {r["session_id"] for r in corral.json("sessions", "list")}
    archived = {r["session_id"]: r for r in corral.json("sessions", "list", "--all")}
    assert archived[sid]["archived"] is True
    corral.run("sessions", "unarchive", sid)
    back = {r["session_id"]: r for r in corral.json("sessions", "list")}
    assert back[sid]["archived"] is False and back[sid]["label"] == "release-candidate"


def test_reindex_rebuilds_the_same_index(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    before = corral.json("sessions", "list", "--all")
    reply = corral.json("sessions", "reindex")
    assert reply["ok"] is True and reply["sessions"] == len(before)
    after = corral.json("sessions", "list", "--all")
    assert [(r["session_id"], r["status"], r["turns"], r["events"], r["label"]) for r in after] \
        == [(r["session_id"], r["status"], r["turns"], r["events"], r["label"]) for r in before]


def test_rewind_then_run_on(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    assert workspace(corral, "rw") == ALL_FILES
    out = corral.run("rewind", "rw", "--to-turn", "2").stdout
    assert "rewound rw" in out and "2 removed" in out
    assert workspace(corral, "rw") == ["a0.txt", "a1.txt"]
    again = corral.json("rewind", "rw", "--to-turn", "2")
    assert again["noop"] is True and again["to_turn"] == 2
    events = [json.loads(line)["event"] for line in
              corral.run("trace", "rw", "--json").stdout.splitlines()]
    assert "rewind" in events
    corral.run("start", "rw")  # the rewound session goes on from turn 3
    corral.wait_session("rw", {"finished"})
    assert workspace(corral, "rw") == ALL_FILES
    assert len(corral.sessions("rw")) == 1


def test_fork_then_start_the_fork(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    parent = session_id(corral, "n1")
    out = corral.run("fork", "n1", "--name", "f1", "--at-turn", "1").stdout
    assert "forked n1 at turn 1" in out
    assert workspace(corral, "f1") == ["a0.txt"]
    forked: dict[str, Any] = corral.sessions("f1")[-1]
    assert forked["parent_session"] == parent and forked["parent_agent"] == "n1"
    assert forked["session_id"] != parent
    corral.run("start", "f1")
    corral.wait_session("f1", {"finished"})
    assert workspace(corral, "f1") == ALL_FILES
    assert workspace(corral, "n1") == ALL_FILES  # the parent is untouched
    taken = corral.run("fork", "n1", "--name", "f1", rc=1)
    assert "f1" in taken.stderr and len(taken.stderr.splitlines()) == 1


def test_purge_a_finished_session(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    sid = session_id(corral, "pg")
    preview = corral.json("sessions", "purge", sid, "--preview")
    assert preview["session_id"] == sid and preview["refused"]["reason"] == "not_archived"
    corral.run("sessions", "purge", sid, "--confirm", sid, rc=1)
    corral.run("sessions", "archive", sid)
    preview = corral.json("sessions", "purge", sid, "--preview")
    assert preview["refused"] is None
    owned = [corral.state_dir / e["path"] for e in preview["entries"]]
    assert owned and all(p.exists() for p in owned)
    corral.run("sessions", "purge", sid, "--confirm", sid)
    assert not any(p.exists() for p in owned)
    assert sid not in {r["session_id"] for r in corral.json("sessions", "list", "--all")}
    corral.run("sessions", "show", sid, rc=1)
    assert corral.run("trace", "pg", "--json").stdout.strip() == ""


def test_du_reports_tiers_and_sessions(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    usage = corral.json("du")
    assert usage["state_dir"] == str(corral.state_dir)
    assert usage["total_bytes"] > 0 and usage["over_cap"] is False
    assert {"recovery-core", "sessions", "audit"} <= set(usage["tiers"])
    assert sum(usage["tiers"].values()) <= usage["total_bytes"]
    assert usage["wal_bytes"] > 0 and usage["tree_packs"] >= 1
    assert usage["sessions"]["n1"]["workspace"] > 0
    text = corral.run("du").stdout
    assert text.startswith(f"{corral.state_dir}:") and "session n1:" in text


def test_gc_dry_run_then_a_pass(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    dry = corral.json("gc", "--dry-run")
    assert dry["dry_run"] is True and dry["wal"]["dry_run"] is True
    text = corral.run("gc", "--dry-run").stdout
    assert text.startswith("gc would remove:")
    done = corral.json("gc")
    assert done["dry_run"] is False and done["wal"]["floor_seq"] >= 1
    assert corral.json("wal", "verify")["sound"] is True


def test_wal_verify_with_state_dir_from_elsewhere(runtime: tuple[Corral, Result]) -> None:
    corral, _ = runtime
    elsewhere = corral.home / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    head = corral.json("status", "writer")["children"][0]["values"]["head_seq"]
    text = corral.run("wal", "verify", "--state-dir", str(corral.state_dir), cwd=elsewhere)
    assert f"WAL {corral.state_dir}: sound" in text.stdout
    report = corral.json("wal", "verify", "--state-dir", str(corral.state_dir), cwd=elsewhere)
    assert report["sound"] is True and report["gaps"] == [] and report["checksum_failures"] == []
    assert report["head_seq"] >= head
    nothing = corral.run("wal", "verify", cwd=elsewhere, rc=2)
    assert nothing.stderr.strip()
