"""Sessions as real processes (docs/sessions.md): a writer, agent processes
run to their end, and `supervisor sessions ...` as a separate command.

- a second run of a finished agent is a new session; a killed one resumes as
  a new run segment, a budget pause too;
- list (filters, --json), show, label, archive/unarchive; the live index
  equals one rebuilt by `reindex`;
- transcripts: one file per segment, the terminal's typed secret sealed;
- purge: each refusal; SIGKILL at every step, then preview and retry
  complete; a purged session is unreachable (show, trace, a new session of
  the same agent).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.kernel.settings import AgentSettings, AgentSpec, Budget, write_spec
from actors.sessions import index, purge
from actors.sessions.ids import new_session_id
from actors.sessions.resolve import SessionPurgingError, resolve
from actors.writer.client import WriterClient
from broker.statedir import StateDir
from tests.agentkit import write_task
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process

SECRET = "s3cret-typed-pw"
WORK = [
    {"op": "write_file", "path": "a.txt", "content": "one\n"},
    {"op": "terminal_input", "proc_id": "t-none", "text": f"{SECRET}\n"},
    {"op": "edit_file", "path": "a.txt", "old": "one", "new": "two"},
    {"op": "finish", "summary": "done"},
]


def cli(processes: ProcessTracker, state_dir: StateDir, *args: str,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "sessions", *args,
         "--state-dir", str(state_dir.root)],
        env=processes.env(env), capture_output=True, text=True, timeout=30, check=False)


def cli_json(processes: ProcessTracker, state_dir: StateDir, *args: str) -> Any:
    done = cli(processes, state_dir, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def start_writer(processes: ProcessTracker, state_dir: StateDir) -> None:
    processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="writer")
    wait_for(lambda: (state_dir.run_dir / "writer.endpoints").exists()
             or (state_dir.run_dir / "writer.sock").exists(), 20, "the writer")


def run_agent(processes: ProcessTracker, state_dir: StateDir, name: str, task: Path, *,
              session: str | None, env: dict[str, str] | None = None,
              settings: AgentSettings | None = None, run: str = "") -> int:
    write_spec(state_dir, name, AgentSpec(
        task=str(task), session=session,
        settings=settings or AgentSettings(exclude=["terminal_input"])))
    agent = processes.spawn(["-m", "actors.agent", "--name", name, "--state-dir",
                             str(state_dir.root)], name=f"{name}{run}", env=env)
    return agent.wait(60)


def status_of(state_dir: StateDir, agent: str) -> dict[str, Any] | None:
    """The agent's newest session as the index has it (read in-process: polled)."""
    conn = index.open_index(state_dir.root)
    try:
        rows = index.list_sessions(conn, include_archived=True, agent=agent)
    finally:
        conn.close()
    return rows[-1] if rows else None


def every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.timeout(180)  # real processes on a shared machine; a few seconds when idle
def test_new_session_after_a_finished_one_cli_reindex_and_transcript(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    start_writer(processes, state_dir)
    task = write_task(tmp_path / "work.yaml", WORK)
    first, second = new_session_id(), new_session_id()
    assert run_agent(processes, state_dir, "a1", task, session=first) == 0
    listed = cli_json(processes, state_dir, "list")
    assert [(r["session_id"], r["agent"], r["status"], r["number"]) for r in listed] == [
        (first, "a1", "finished", 1)]
    # a second run of the finished agent is a new session, not the old one finished
    assert run_agent(processes, state_dir, "a1", task, session=second, run="b") == 0
    rows = {r["session_id"]: r for r in cli_json(processes, state_dir, "list")}
    assert set(rows) == {first, second}
    assert rows[second]["previous"] == first and rows[second]["number"] == 2
    assert rows[second]["turns"] == rows[first]["turns"] == 4
    assert rows[second]["first_seq"] > rows[first]["last_seq"]
    assert (state_dir.agent_dir("a1") / "workspace" / "a.txt").read_text() == "two\n"
    # the same spec again (a restart by the policy) does not begin a third session
    assert run_agent(processes, state_dir, "a1", task, session=second, run="c") == 0
    assert len(cli_json(processes, state_dir, "list", "--agent", "a1")) == 2

    # label, archive, filters
    assert first[:6] == second[:6]  # the time part: minted within days of each other
    both = cli(processes, state_dir, "label", first[:6], "x")
    assert both.returncode == 1 and "more than one" in both.stderr
    assert cli(processes, state_dir, "label", first, "baseline run").returncode == 0
    assert cli(processes, state_dir, "archive", first).returncode == 0
    assert [r["session_id"] for r in cli_json(processes, state_dir, "list")] == [second]
    everything = cli_json(processes, state_dir, "list", "--all")
    assert [r["session_id"] for r in everything] == [first, second]
    labelled = cli_json(processes, state_dir, "list", "--all", "--label", "baseline run")
    assert [(r["session_id"], r["archived"]) for r in labelled] == [(first, True)]
    assert cli_json(processes, state_dir, "list", "--label", "baseline run") == []
    assert cli(processes, state_dir, "unarchive", first).returncode == 0
    text = cli(processes, state_dir, "show", first)
    assert text.returncode == 0 and "baseline run" in text.stdout
    assert "archived        -" in text.stdout
    missing = cli(processes, state_dir, "show", "no-such-agent")
    assert missing.returncode == 1 and "no session" in missing.stderr

    # the index built bit by bit equals one rebuilt from the WAL
    conn = index.open_index(state_dir.root)
    live = index.derived_snapshot(conn)
    conn.close()
    assert cli_json(processes, state_dir, "reindex")["sessions"] == 2
    conn = index.connect(state_dir.root)
    rebuilt = index.derived_snapshot(conn)
    labels = conn.execute("SELECT label FROM labels").fetchall()
    conn.close()
    assert rebuilt == live and len(live["sessions"]) == 2
    assert [tuple(r) for r in labels] == [("baseline run",)]  # owned rows are kept

    # transcripts: a file per session, the typed secret sealed
    lines = (state_dir.root / "sessions" / first / "transcript.jsonl").read_text().splitlines()
    assert [json.loads(line)["turn"] for line in lines] == [1, 2, 3, 4]
    assert "<sealed sha256:" in lines[1] and SECRET not in lines[1]
    for path in every_file(state_dir.root):
        assert SECRET.encode() not in path.read_bytes(), path

    # a rewind stays in the newest session; a fork starts from an earlier one
    def top(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--state-dir",
                               str(state_dir.root)], env=processes.env(None),
                              capture_output=True, text=True, timeout=30, check=False)

    refused = top("rewind", first, "--to-turn", "1")
    assert refused.returncode == 2 and "fork" in refused.stderr, refused.stderr
    forked = top("fork", first, "--name", "from-first", "--at-turn", "1", "--json")
    assert forked.returncode == 0, forked.stderr
    made = json.loads(forked.stdout)
    assert made["session"] == first and made["point_turn"] == 1
    assert made["point_seq"] <= rows[first]["last_seq"]
    assert (state_dir.agent_dir("from-first") / "workspace" / "a.txt").read_text() == "one\n"


@pytest.mark.timeout(180)  # real processes on a shared machine; a few seconds when idle
def test_run_segments_after_a_kill_and_a_budget_pause(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    start_writer(processes, state_dir)
    task = write_task(tmp_path / "work.yaml", WORK)
    # killed after its first result: the restart is a new run segment
    third = new_session_id()
    code = run_agent(processes, state_dir, "k1", task, session=third,
                     env={"CORRAL_AGENT_FAULT": "after_tool_result@1.0"})
    assert code == -signal.SIGKILL
    assert run_agent(processes, state_dir, "k1", task, session=third, run="b") == 0
    shown = cli_json(processes, state_dir, "show", "k1")
    assert shown["session_id"] == third and shown["status"] == "finished"
    assert [(s["segment"], s["reason"]) for s in shown["segment_list"]] == [
        (1, "start"), (2, "restart")]
    # a budget pause, then more budget: a third kind of segment
    paused = new_session_id()
    write_spec(state_dir, "p1", AgentSpec(task=str(task), session=paused, settings=AgentSettings(
        exclude=["terminal_input"], budget=Budget(tokens=60))))
    agent = processes.spawn(["-m", "actors.agent", "--name", "p1", "--state-dir",
                             str(state_dir.root)], name="p1")
    wait_for(lambda: (status_of(state_dir, "p1") or {}).get("status") == "paused", 30,
             "the budget pause")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    writer = WriterClient(ctx, state_dir, "operator")
    try:
        writer.append("agent/p1", "budget_resumed", {"tokens": 10_000, "cost_units": 0,
                                                     "segment": 1},
                      key=f"resume:{paused}:s1", ledger="budget")
    finally:
        writer.close()
        ctx.destroy(linger=0)
    assert agent.wait(60) == 0
    segs = cli_json(processes, state_dir, "show", paused[:12])["segment_list"]
    assert [s["reason"] for s in segs] == ["start", "budget"]
    # the killed session's transcript: segment 1 kept under its number
    sessions = state_dir.root / "sessions"
    before = [json.loads(x) for x in (sessions / third / "transcript.pre_seg_1.jsonl")
              .read_text().splitlines()]
    after = [json.loads(x) for x in (sessions / third / "transcript.jsonl").read_text()
             .splitlines()]
    assert [e["segment"] for e in before] == [1]
    assert after and all(e["segment"] == 2 for e in after)
    assert [e["turn"] for e in before + after] == [1, 2, 3, 4]
    conn = index.open_index(state_dir.root)
    live = index.derived_snapshot(conn)
    conn.close()
    conn = index.reindex(state_dir.root)
    assert index.derived_snapshot(conn) == live
    conn.close()


def _purge(processes: ProcessTracker, state_dir: StateDir, sid: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli(processes, state_dir, "purge", sid, "--confirm", sid, env=env)


@pytest.mark.timeout(180)  # real processes on a shared machine; a few seconds when idle
def test_purge_refusals(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    start_writer(processes, state_dir)
    task = write_task(tmp_path / "work.yaml", WORK)
    ask = write_task(tmp_path / "ask.yaml", [{"op": "ask", "question": "go on?"}])
    # refusals: not archived, not the full id, ids that differ, waiting for the operator
    done = new_session_id()
    assert run_agent(processes, state_dir, "p1", task, session=done) == 0
    refused = _purge(processes, state_dir, done)
    assert refused.returncode == 1 and "not archived" in refused.stderr
    assert cli(processes, state_dir, "archive", "p1").returncode == 0
    short = cli(processes, state_dir, "purge", done[:10], "--confirm", done[:10])
    assert short.returncode == 1 and "not a full session id" in short.stderr
    other = cli(processes, state_dir, "purge", done, "--confirm", new_session_id())
    assert other.returncode == 2
    waiting = new_session_id()
    write_spec(state_dir, "q1", AgentSpec(task=str(ask), session=waiting))
    asker = processes.spawn(["-m", "actors.agent", "--name", "q1", "--state-dir",
                             str(state_dir.root)], name="q1")
    wait_for(lambda: (status_of(state_dir, "q1") or {}).get("pending_input") == 1, 30,
             "the question")
    asker.send_signal(signal.SIGKILL)
    asker.wait(10)
    assert cli(processes, state_dir, "archive", waiting).returncode == 0
    pending = _purge(processes, state_dir, waiting)
    assert pending.returncode == 1 and "waits for the operator" in pending.stderr
    preview = cli_json(processes, state_dir, "purge", waiting, "--preview")
    assert preview["refused"]["reason"] == "pending_input"
    # a session not over whose agent's process is live (the supervisor's status
    # says so) is refused as running; one whose agent is stopped is not
    running = purge.refusal(state_dir.root, waiting, agent_state=lambda agent: "running")
    assert running is not None and running.reason == "running" and "q1" in str(running)
    stopped = purge.refusal(state_dir.root, waiting, agent_state=lambda agent: None)
    assert stopped is not None and stopped.reason == "pending_input"
    over = purge.refusal(state_dir.root, done, agent_state=lambda agent: "running")
    assert over is None  # a finished, archived session is purged even then
    assert (state_dir.root / "sessions" / done).exists()  # nothing refused was touched
    conn = index.connect(state_dir.root)
    assert conn.execute("SELECT COUNT(*) FROM purge_journal").fetchone()[0] == 0
    conn.close()


@pytest.mark.timeout(240)  # real processes on a shared machine; ~10 s when idle
def test_purge_killed_at_every_step_then_retried_leaves_nothing_reachable(
        processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> None:
    start_writer(processes, state_dir)
    task = write_task(tmp_path / "work.yaml", WORK)
    purged: list[dict[str, Any]] = []
    steps = ("journaled", "staging", "staged", "removing", "files_removed")
    ids = {step: new_session_id() for step in steps}
    agents = []
    for n, step in enumerate(steps):  # one finished session per step, run at once
        write_spec(state_dir, f"p{n}", AgentSpec(
            task=str(task), session=ids[step],
            settings=AgentSettings(exclude=["terminal_input"])))
        agents.append(processes.spawn(["-m", "actors.agent", "--name", f"p{n}",
                                       "--state-dir", str(state_dir.root)], name=f"p{n}"))
    assert [a.wait(60) for a in agents] == [0] * len(steps)
    for n, step in enumerate(steps):
        sid = ids[step]
        conn = index.open_index(state_dir.root)
        index.set_archived(conn, sid, True)
        conn.close()
        before = purge.plan_for(state_dir.root, sid)
        assert before.step is None
        assert any(e["path"].endswith("transcript.jsonl") for e in before.entries)
        effects = state_dir.agent_dir(f"p{n}") / "effects"  # the session's write notes
        assert any(e["path"].endswith(f"journal@{sid}.jsonl") for e in before.entries)
        assert list(effects.glob(f"journal@{sid}.jsonl"))
        killed = _purge(processes, state_dir, sid, env={"CORRAL_PURGE_FAULT": step})
        assert killed.returncode == -signal.SIGKILL, (step, killed.stderr)
        if step == "journaled":  # what the operator sees of an interrupted purge
            shown = cli_json(processes, state_dir, "purge", sid, "--preview")
            assert shown["journal"] == "journaled" and shown["entries"], shown
        halfway = purge.plan_for(state_dir.root, sid)
        assert halfway.step in ("journaled", "staged", "files_removed"), step
        with pytest.raises(SessionPurgingError, match="being purged"):
            resolve(state_dir.root, sid)  # an interrupted purge blocks ordinary use
        with pytest.raises(SessionPurgingError, match="being purged"):
            resolve(state_dir.root, f"p{n}")  # by its agent's name too
        assert _purge(processes, state_dir, sid).returncode == 0, step
        purged.append(before.as_dict())
        assert not (state_dir.root / "sessions" / sid).exists()
        assert not (state_dir.root / "purge-staging" / sid).exists()
        assert not list(effects.glob(f"*@{sid}*"))
        with pytest.raises(SessionPurgingError, match="purged"):
            resolve(state_dir.root, sid)
    gone = cli(processes, state_dir, "show", sid)
    assert gone.returncode == 1 and "purged" in gone.stderr
    conn = index.connect(state_dir.root)
    journal = [dict(r) for r in conn.execute("SELECT * FROM purge_journal")]
    conn.close()
    assert len(journal) == 5 and {j["state"] for j in journal} == {"done"}
    assert sorted(j["stream"] for j in journal) == [f"agent/p{n}" for n in range(5)]
    # unreachable: no row, no trace line, no state of a new session of p1
    assert cli_json(processes, state_dir, "list", "--all") == []
    fresh = new_session_id()
    assert run_agent(processes, state_dir, "p1", task, session=fresh, run="last") == 0
    shown = cli_json(processes, state_dir, "show", "p1")
    assert shown["session_id"] == fresh and shown["number"] == 1 and shown["turns"] == 4
    trace = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "trace", "p1", "--json",
         "--state-dir", str(state_dir.root)],
        env=processes.env(), capture_output=True, text=True, timeout=30, check=False)
    assert trace.returncode == 0, trace.stderr
    seqs = [json.loads(line)["seq"] for line in trace.stdout.splitlines()]
    assert seqs and all(not (j["first_seq"] <= s <= j["last_seq"]) for s in seqs
                        for j in journal)
    assert min(seqs) == shown["first_seq"]
    conn = index.reindex(state_dir.root)  # a rebuild from the WAL does not bring them back
    left = {r["session_id"] for r in index.list_sessions(conn, include_archived=True)}
    conn.close()
    assert left == {fresh}

