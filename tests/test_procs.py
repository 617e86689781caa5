"""The procs host with real programs: foreground and background commands,
`python3 -i` on a PTY, output caps (`yes`), lifetimes, a command that ignores
SIGTERM, grandchildren that leave the group (nohup, double fork, setsid),
an agent SIGKILLed while its commands run, and procs itself SIGKILLed:
re-attached or reported lost, and never an orphan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import zmq

from actors.kernel.settings import AgentSpec, write_spec
from actors.procs import launch
from actors.procs.client import ProcsClient
from actors.procs.launch import ENV_PROC_ID
from actors.writer.client import WriterClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.process
SESSION = "agent-1"
GRACE_S = 0.3


@dataclass
class Stack:
    state: StateDir
    processes: ProcessTracker
    ctx: zmq.Context[zmq.Socket[bytes]]
    peer: BrokerPeer
    client: ProcsClient
    writer: WriterClient
    procs: subprocess.Popen[bytes]
    workdir: Path

    def start_procs(self) -> None:
        self.procs = self.processes.spawn(
            ["-m", "actors.procs", "--state-dir", str(self.state.root),
             "--kill-grace-s", str(GRACE_S), "--broker-heartbeat-interval-ms", "200",
             "--log-level", "debug"],
            name="procs",
        )

        def answered() -> bool:
            assert self.procs.poll() is None, self.processes.output("procs")
            try:
                reply = self.peer.request("procs", protocol.Ping(msg_id=f"w{time.monotonic_ns()}"),
                                          timeout_s=0.2, retries=0)
            except (RequestTimeoutError, RemoteError):
                return False
            return isinstance(reply, protocol.Pong)

        # three fresh interpreters (writer, broker, procs) import at once: 5-10 s under load
        wait_for(answered, 30, "procs to answer a ping")

    def facts(self, event: str | None = None) -> list[dict[str, object]]:
        out = []
        for record in self.writer.read_stream(f"procs/{SESSION}"):
            if event is None or record.event == event:
                payload = record.payload()
                assert isinstance(payload, dict)
                out.append({"event": record.event, **payload})
        return out


def marked(proc_id: str) -> list[psutil.Process]:
    """The live processes of a job: those carrying its marker (the wrapper;
    the sandbox's bwrap and pid 1, named by their hostname argument) and all
    their descendants (inside the sandbox nothing carries a CORRAL_ variable).
    A marker is the proc id scoped to its runtime: `<proc_id>.<runtime>`."""
    mark = f"{proc_id}."
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if (proc.environ().get(ENV_PROC_ID, "").startswith(mark)
                    or any(a.startswith(f"corral-{mark}") for a in proc.cmdline())):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    if child.status() != psutil.STATUS_ZOMBIE:
                        found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


@pytest.fixture
def stack(processes: ProcessTracker, state_dir: StateDir) -> Iterator[Stack]:
    processes.spawn(["-m", "actors.writer", "--state-dir", str(state_dir.root)], name="writer")
    yield from procs_stack(processes, state_dir, zmq.Context())


def procs_stack(processes: ProcessTracker, state_dir: StateDir,
                ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Stack]:
    """A broker and procs over the writer the caller started first, with the
    session SESSION's spec and workspace; `ctx` is destroyed at the end."""
    processes.spawn(["-m", "broker.server", "--state-dir", str(state_dir.root),
                     "--heartbeat-interval-ms", "200"], name="broker")
    peer = BrokerPeer(ctx, state_dir, SESSION, heartbeat_interval_s=0.2)
    writer = WriterClient(ctx, state_dir, "test")
    workdir = state_dir.root.parent / "work"
    workdir.mkdir()
    # the session's workspace (procs reads it from the agent's spec): the only
    # place its commands may write, and where their cwd must lie
    write_spec(state_dir, SESSION, AgentSpec(task="unused.yaml", workspace=str(workdir)))
    s = Stack(state_dir, processes, ctx, peer, ProcsClient(peer, SESSION), writer,
              processes.started[0], workdir)
    try:
        s.start_procs()
        yield s
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)


def read_all(client: ProcsClient, proc_id: str, *, terminal: bool = False,
             timeout_s: float = 20) -> tuple[bytes, protocol.ProcOutput]:
    """Poll by cursor until eof (bounded wait); return every byte."""
    data = bytearray()
    last: list[protocol.ProcOutput] = []

    def done() -> bool:
        out = (client.terminal_read if terminal else client.poll)(proc_id, len(data))
        assert out.cursor == len(data)
        data.extend(out.data)
        last[:] = [out]
        return out.eof

    wait_for(done, timeout_s, f"eof of {proc_id}", interval_s=0.02)
    return bytes(data), last[0]


def test_foreground_bash_returns_combined_output_and_exit_code(stack: Stack) -> None:
    out = stack.client.bash("echo out; echo err >&2; exit 3", str(stack.workdir))
    assert (out.data, out.state, out.exit_code, out.eof) == (b"out\nerr\n", "exited", 3, True)
    log = stack.state.agent_dir(SESSION) / ".procs" / f"{out.proc_id}.log"
    assert log.read_bytes() == b"out\nerr\n"
    piped = stack.client.bash("yes | head -c 6", str(stack.workdir))
    assert piped.data == b"y\ny\ny\n"  # SIGPIPE at its default: `yes` dies quietly
    timed = stack.client.bash("sleep 30", str(stack.workdir), timeout_s=0.3)
    assert timed.state == "expired"
    assert not marked(timed.proc_id)
    events = [f["event"] for f in stack.facts()]
    assert events.count("proc_start") == 3
    assert "proc_exit" in events
    assert "proc_poll" in events
    start = stack.facts("proc_start")[0]
    assert "command" not in start
    assert start["command_bytes"] == len(b"echo out; echo err >&2; exit 3")


def test_a_foreground_command_resent_while_it_runs_is_answered_once(stack: Stack) -> None:
    """The agent resends a foreground command's request while it waits
    (client.FOREGROUND_RESEND_S): procs finds the running job and answers the
    resends with the one reply already waiting, once, and starts nothing
    twice. The reply is followed by procs' answer to a ping sent after it, so a
    second reply (sent in the same loop turn as the first) would come first."""
    go = stack.workdir / "go"
    bash = protocol.Bash(msg_id="b:resent", session=SESSION,
                         command="while [ ! -f go ]; do sleep 0.05; done; echo done",
                         cwd=str(stack.workdir), timeout_s=60, max_bytes=4096)
    for _ in range(3):
        stack.peer.send("procs", bash)
    wait_for(lambda: len(stack.facts("proc_start")) == 1, 10, "the command to start")
    go.write_text("")
    replies: list[protocol.Message] = []

    def replied() -> bool:
        item = stack.peer.recv(0.1)
        if item is not None:
            replies.append(item[1])
        return bool(replies)

    wait_for(replied, 20, "the command's reply")
    stack.peer.send("procs", protocol.Ping(msg_id="after-reply"))

    def ponged() -> bool:
        item = stack.peer.recv(0.1)
        if item is not None:
            replies.append(item[1])
        return isinstance(replies[-1], protocol.Pong)

    wait_for(ponged, 10, "procs to answer the ping")
    outputs = [r for r in replies if isinstance(r, protocol.ProcOutput)]
    assert [o.msg_id for o in outputs] == ["b:resent"]
    assert outputs[0].data == b"done\n"
    assert len(stack.facts("proc_start")) == 1


def test_background_command_is_polled_by_cursor_and_refusals_are_typed(stack: Stack) -> None:
    started = stack.client.start("for i in $(seq 1 200); do echo line-$i; done; exit 7",
                                 str(stack.workdir))
    assert started.state == "running"
    data, last = read_all(stack.client, started.proc_id)
    assert data == b"".join(b"line-%d\n" % i for i in range(1, 201))
    assert (last.state, last.exit_code) == ("exited", 7)
    small = stack.client.poll(started.proc_id, cursor=10, max_bytes=5)
    assert small.data == data[10:15] and small.next_cursor == 15
    with pytest.raises(RemoteError) as info:
        stack.client.poll("p-0000000000000000")
    assert info.value.code == "not_found"
    other = ProcsClient(stack.peer, "agent-2")
    with pytest.raises(RemoteError) as info:
        other.poll(started.proc_id)  # another session is not agent-1's to name
    assert info.value.code == "forbidden"
    with pytest.raises(RemoteError) as info:
        stack.client.start("true", "relative/dir")
    assert info.value.code == "invalid_message"
    again = stack.client.start("echo once >> once.txt", str(stack.workdir), msg_id="fixed-id")
    # a resend under the same msg_id (from another connection: the operator's,
    # which may act on any session) finds the same job
    resender = BrokerPeer(stack.ctx, stack.state, "operator", heartbeat_interval_s=0.2)
    try:
        same = ProcsClient(resender, SESSION).start("echo once >> once.txt", str(stack.workdir),
                                                    msg_id="fixed-id")
    finally:
        resender.close()
    assert again.proc_id == same.proc_id
    read_all(stack.client, again.proc_id)
    assert (stack.workdir / "once.txt").read_text() == "once\n"


def test_python_repl_through_a_terminal(stack: Stack) -> None:
    term = stack.client.terminal_start([sys.executable, "-i", "-q"], str(stack.workdir))
    seen = bytearray()

    def shows(text: bytes) -> bool:
        out = stack.client.terminal_read(term.proc_id, len(seen))
        seen.extend(out.data)
        return text in seen

    wait_for(lambda: shows(b">>> "), 10, "the first prompt")
    stack.client.terminal_input(term.proc_id, b"print(6 * 7)\n")
    wait_for(lambda: shows(b"42\r\n>>> "), 10, "the answer and the next prompt")
    stack.client.terminal_input(term.proc_id, b"import sys; sys.stdout.write('bye\\n'); exit(5)\n")
    data, last = read_all(stack.client, term.proc_id, terminal=True)
    assert b"bye" in data  # written just before exit: never lost
    assert (last.state, last.exit_code) == ("exited", 5)
    inputs = stack.facts("terminal_input")
    assert [f["data_bytes"] for f in inputs] == [13, 47]
    wal = b"".join(p.read_bytes() for p in stack.state.wal_dir.iterdir())
    assert b"print(6 * 7)" not in wal  # input is recorded as a hash and a size


def test_output_cap_terminates_a_flood(stack: Stack) -> None:
    cmd = stack.client.start("yes", str(stack.workdir), max_output_bytes=1_000_000)
    term = stack.client.terminal_start(["yes"], str(stack.workdir), max_output_bytes=300_000)
    data, last = read_all(stack.client, cmd.proc_id)
    assert len(data) == 1_000_000 and last.state == "capped"
    tdata, tlast = read_all(stack.client, term.proc_id, terminal=True)
    assert len(tdata) == 300_000 and tlast.state == "capped"
    assert not marked(cmd.proc_id) and not marked(term.proc_id)


def test_lifetime_expires_a_terminal_and_a_command(stack: Stack) -> None:
    term = stack.client.terminal_start(["sleep", "60"], str(stack.workdir), lifetime_s=0.3)
    cmd = stack.client.start("sleep 60", str(stack.workdir), lifetime_s=0.3)
    assert read_all(stack.client, term.proc_id, terminal=True)[1].state == "expired"
    assert read_all(stack.client, cmd.proc_id)[1].state == "expired"


def test_kill_ends_a_command_that_ignores_sigterm_and_every_grandchild(stack: Stack) -> None:
    stubborn = stack.client.start("trap '' TERM; echo armed; while :; do sleep 0.05; done",
                                  str(stack.workdir))
    family = stack.client.start(
        "nohup sleep 300 >/dev/null 2>&1 & (sleep 301 &) ; setsid sleep 302 & echo spawned; wait",
        str(stack.workdir))
    wait_for(lambda: b"armed" in stack.client.poll(stubborn.proc_id).data, 10, "trap armed")
    def sleepers() -> tuple[int, int]:
        """(sleeps running, of which outside the command's process group)."""
        inside = outside = 0
        for proc in marked(family.proc_id):
            try:
                if proc.name() != "sleep":
                    continue
                if os.getpgid(proc.pid) == family.pid:
                    inside += 1
                else:
                    outside += 1
            except (psutil.Error, ProcessLookupError):
                continue
        return inside + outside, outside

    # nohup, double fork, setsid: the last left the group, only the marker sweep finds it
    wait_for(lambda: sleepers() == (3, 1), 10, "three grandchildren, one outside the group")
    t0 = time.monotonic()
    killed = stack.client.kill(stubborn.proc_id)
    assert killed.state == "killed"
    assert time.monotonic() - t0 >= GRACE_S  # SIGTERM was ignored: SIGKILL after the grace
    assert not marked(stubborn.proc_id)
    assert stack.client.kill(family.proc_id).state == "killed"
    assert not marked(family.proc_id)
    assert [f["reason"] for f in stack.facts("proc_kill")] == ["request", "request"]


def test_session_end_tears_down_commands_terminals_and_grandchildren(stack: Stack) -> None:
    ids = [stack.client.start("nohup sleep 300 >/dev/null 2>&1 & sleep 300",
                              str(stack.workdir)).proc_id for _ in range(3)]
    ids.append(stack.client.terminal_start(["bash", "-c", "(sleep 300 &); sleep 300"],
                                           str(stack.workdir)).proc_id)
    wait_for(lambda: all(len(marked(i)) >= 2 for i in ids), 10, "everything started")
    ended = stack.client.end_session()
    assert ended.ended == 4
    assert all(not marked(i) for i in ids)
    assert stack.facts("session_end")[0]["ended"] == 4
    # forgotten by the registry, answered from the job's files (audit evidence)
    out = stack.client.poll(ids[0])
    assert (out.state, out.eof) == ("killed", True)
    with pytest.raises(RemoteError):
        stack.client.poll("p-0123456789abcdef")  # never started: no files


def test_agent_sigkilled_restarted_agent_reads_every_byte(stack: Stack) -> None:
    """The 'agent' is a separate process; after its SIGKILL a new peer rebuilds
    the proc ids from the WAL (proc_start facts) and reads every byte."""
    script = (
        "import sys, zmq; from broker.statedir import StateDir; "
        "from broker.peer import BrokerPeer; from actors.procs.client import ProcsClient; "
        f"st = StateDir.at({str(stack.state.root)!r}); ctx = zmq.Context(); "
        "c = ProcsClient(BrokerPeer(ctx, st, 'operator'), 'agent-1'); "
        "[c.start(f'for i in $(seq 1 40); do echo {n}-$i; sleep 0.01; done', "
        f"{str(stack.workdir)!r}) for n in range(3)]; "
        "print('started', flush=True); import time; time.sleep(300)"
    )
    agent = stack.processes.spawn(["-c", script], name="agent")
    wait_for(lambda: "started" in stack.processes.output("agent"), 30, "the agent's starts")
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    proc_ids = [str(f["proc_id"]) for f in stack.facts("proc_start")]
    assert len(proc_ids) == 3
    seen = set()
    for proc_id in proc_ids:
        data, last = read_all(stack.client, proc_id)
        assert last.state == "exited"
        lines = data.splitlines()
        n = lines[0].split(b"-")[0]
        assert lines == [b"%s-%d" % (n, i) for i in range(1, 41)]
        seen.add(n)
    assert seen == {b"0", b"1", b"2"}


def test_procs_sigkilled_reattaches_commands_reports_terminals_lost_no_orphan(
    stack: Stack,
) -> None:
    # the long command outlives procs' restart by waiting for a file the test
    # creates afterwards (a fixed sleep would race a slow restart on a busy box)
    gate = stack.workdir / "release-long"
    long = stack.client.start(
        f"echo begin; while [ ! -e {gate} ]; do sleep 0.02; done; echo end", str(stack.workdir)
    )
    short = stack.client.start("sleep 0.3; echo done; exit 4", str(stack.workdir))
    term = stack.client.terminal_start(["bash", "-c", "trap '' HUP; sleep 300"],
                                       str(stack.workdir))
    wait_for(lambda: marked(term.proc_id), 10, "the terminal's program")
    os.killpg(stack.procs.pid, signal.SIGKILL)
    stack.procs.wait()
    wait_for(lambda: not marked(short.proc_id), 10, "the short command to end while procs is down")
    stack.start_procs()
    assert not marked(term.proc_id)  # a terminal cannot be re-attached: ended, reported lost
    gate.touch()
    data, last = read_all(stack.client, long.proc_id)
    assert (data, last.state, last.exit_code) == (b"begin\nend\n", "exited", 0)
    sdata, slast = read_all(stack.client, short.proc_id)
    assert (sdata, slast.state, slast.exit_code) == (b"done\n", "exited", 4)
    assert stack.client.terminal_read(term.proc_id).state == "lost"
    assert [f["proc_id"] for f in stack.facts("proc_lost")] == [term.proc_id]
    assert [f["proc_id"] for f in stack.facts("proc_reattached")] == [long.proc_id]
    registry = json.loads((stack.state.root / "procs" / "registry.json").read_text())
    assert {e["proc_id"] for e in registry["entries"]} == {long.proc_id, short.proc_id,
                                                            term.proc_id}
    stack.client.end_session()


def test_a_start_resent_after_procs_forgot_the_job_is_answered_from_its_files(
    stack: Stack,
) -> None:
    """procs' registry keeps only the newest ended jobs; after a restart that
    let a job go, a poll of it and a start resent under the same msg_id (an
    agent re-running its call late) find the job's files: it is not run again."""
    tally = stack.workdir / "tally"
    first = stack.client.start(f"echo ran >> {tally}; exit 3", str(stack.workdir),
                               msg_id="s:7.0")
    term = stack.client.terminal_start(["bash", "-c", "exit 0"], str(stack.workdir),
                                       msg_id="t:8.0")
    read_all(stack.client, first.proc_id)
    read_all(stack.client, term.proc_id, terminal=True)
    os.killpg(stack.procs.pid, signal.SIGKILL)
    stack.procs.wait()
    path = stack.state.root / "procs" / "registry.json"
    registry = json.loads(path.read_text())
    registry["entries"] = []  # as if newer jobs had pushed both out of the window
    path.write_text(json.dumps(registry))
    # without the final states noted beside the logs (the session_end test reads
    # one), the command is known from its exit file and the terminal not at all
    agent_dir = stack.state.agent_dir(SESSION)
    (agent_dir / ".procs" / f"{first.proc_id}.end").unlink()
    (agent_dir / ".terminals" / f"{term.proc_id}.end").unlink()
    stack.start_procs()
    # the agent that resends is a new process (a peer ignores replies to msg_ids it
    # already finished): here the operator's connection, which may act on any session
    restarted = BrokerPeer(stack.ctx, stack.state, "operator", heartbeat_interval_s=0.2)
    client = ProcsClient(restarted, SESSION)
    data, last = read_all(client, first.proc_id)  # a poll finds the forgotten job
    assert (last.state, last.exit_code, data) == ("exited", 3, b"")
    again = client.start(f"echo ran >> {tally}; exit 3", str(stack.workdir), msg_id="s:7.0")
    assert (again.proc_id, again.state, again.exit_code) == (first.proc_id, "exited", 3)
    assert tally.read_text() == "ran\n"  # ran once
    term_again = client.terminal_start(["bash", "-c", "exit 0"], str(stack.workdir),
                                       msg_id="t:8.0")
    assert (term_again.proc_id, term_again.state) == (term.proc_id, "lost")
    assert len(stack.facts("proc_start")) == 1 and len(stack.facts("terminal_start")) == 1
    # procs' facts carry the session's own origin: a window of idempotency keys each
    origins = {r.origin for r in stack.writer.read_stream(f"procs/{SESSION}")}
    assert origins == {f"procs/{SESSION}"}
    killed = stack.client.kill(first.proc_id)  # an ended job known from files: no group signal
    assert killed.state == "exited"
    restarted.close()


def test_status_values_reach_the_supervisor_heartbeat(stack: Stack) -> None:
    cmd = stack.client.start("sleep 30", str(stack.workdir))
    stats = stack.peer.request("procs", protocol.StatsRequest(msg_id="s1"), timeout_s=5)
    assert isinstance(stats, protocol.Stats)
    assert stats.values["live_commands"] == 1
    assert stats.values["live_terminals"] == 0
    stack.client.kill(cmd.proc_id)


def test_sigterm_stops_procs_after_ending_every_job(stack: Stack) -> None:
    cmd = stack.client.start("trap '' TERM; sleep 300", str(stack.workdir))
    term = stack.client.terminal_start(["sleep", "300"], str(stack.workdir))
    wait_for(lambda: marked(cmd.proc_id) and marked(term.proc_id), 10, "both running")
    stack.procs.send_signal(signal.SIGTERM)
    assert stack.procs.wait(15) == 0
    assert not marked(cmd.proc_id) and not marked(term.proc_id)
    registry = json.loads((stack.state.root / "procs" / "registry.json").read_text())
    assert {e["state"] for e in registry["entries"]} == {"killed"}


def test_a_job_marker_is_scoped_to_its_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A proc id is a digest of (session, msg_id): two runtimes on one host whose
    agents share a name and a call id name their jobs alike. One runtime's sweep
    must neither find nor end the other's processes (before the fix, ending a job
    in one killed the other's, and its `settled` waited on them)."""
    proc_id = "p-0123456789abcdef"
    monkeypatch.setitem(launch._SCOPE, "runtime", "")  # restored after the test
    launch.scope_markers(str(tmp_path / "a" / ".corral"))
    theirs = subprocess.Popen(["sleep", "60"], env=launch.job_env(os.environ, proc_id))
    try:
        wait_for(lambda: theirs.pid in launch.marked_pids(proc_id, False), 10,
                 "the job found by its own runtime")
        launch.scope_markers(str(tmp_path / "b" / ".corral"))  # another runtime, the same id
        assert theirs.pid not in launch.marked_pids(proc_id, None)
        assert launch.tree_gone(0, proc_id, group=False)
        launch.end_tree(0, proc_id, signal.SIGKILL, group=False)
        assert theirs.poll() is None  # not ours to end
        launch.scope_markers(str(tmp_path / "a" / ".corral"))  # its own runtime, restarted
        assert theirs.pid in launch.marked_pids(proc_id, None)
    finally:
        theirs.kill()
        theirs.wait(10)


def test_a_fenced_runtimes_sweep_ends_its_own_jobs_and_no_other_runtimes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`end_runtime_jobs` (a host come back fenced) kills every process marked as
    a job of its runtime, by the environment or by a sandbox's `--hostname`, and
    nothing marked for another runtime, whatever the proc id; a process that
    spells a marker without the runtime's part is not taken for one either."""
    mine, other = str(tmp_path / "a" / ".corral"), str(tmp_path / "b" / ".corral")
    monkeypatch.setitem(launch._SCOPE, "runtime", "")  # restored after the test
    started: list[subprocess.Popen[bytes]] = []

    def job(root: str, proc_id: str) -> subprocess.Popen[bytes]:
        launch.scope_markers(root)
        started.append(subprocess.Popen(["sleep", "60"], env=launch.job_env(os.environ, proc_id)))
        return started[-1]

    def named(argv1: str) -> subprocess.Popen[bytes]:  # a sandbox's bwrap, by its cmdline
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                         "--hostname", argv1]))
        return started[-1]

    try:
        own = [job(mine, "p-1111111111111111"), job(mine, "t-2222222222222222"),
               named(f"corral-p-3333333333333333.{launch.runtime_scope(mine)}")]
        theirs = [job(other, "p-1111111111111111"),
                  named(f"corral-p-3333333333333333.{launch.runtime_scope(other)}"),
                  named("corral-p-3333333333333333")]  # no runtime part: nobody's sweep
        wait_for(lambda: {p.pid for p in own} <= set(launch.runtime_job_pids(mine)), 10,
                 "the runtime's jobs found")
        assert not {p.pid for p in theirs} & set(launch.runtime_job_pids(mine))
        assert {p.pid for p in own} <= set(launch.end_runtime_jobs(mine))
        for proc in own:
            assert proc.wait(10) == -signal.SIGKILL
        assert all(proc.poll() is None for proc in theirs)  # not its to end
        assert launch.runtime_job_pids(mine) == []
    finally:
        for proc in started:
            proc.kill()
            proc.wait(10)


def test_the_registry_file_keeps_live_jobs_and_only_the_newest_ended_ones(tmp_path: Path) -> None:
    from actors.procs import registry as reg

    registry = reg.Registry(tmp_path / "registry.json")
    for i in range(reg.KEEP_ENDED + 50):
        registry.put(reg.Entry(proc_id=f"p-{i:016x}", kind="command", session="s", pid=1000 + i,
                               start_ticks=1, log_path="l", exit_path="e", cap_bytes=1,
                               deadline_wall=0.0, state="exited", exit_code=0))
    registry.put(reg.Entry(proc_id="p-ffffffffffffffff", kind="command", session="s", pid=9,
                           start_ticks=1, log_path="l", exit_path="e", cap_bytes=1,
                           deadline_wall=0.0))
    registry.save()
    loaded = reg.Registry.load(tmp_path / "registry.json")
    assert "p-ffffffffffffffff" in loaded.entries  # the running one, whatever its age
    ended = [e for e in loaded.entries.values() if e.state == "exited"]
    assert len(ended) == reg.KEEP_ENDED
    assert ended[-1].proc_id == f"p-{reg.KEEP_ENDED + 49:016x}"  # the newest are kept
    assert registry.entries.keys() == loaded.entries.keys()  # memory forgets the rest too
    # "newest" is the order jobs ended in: the long runner that ends now is kept
    registry.entries["p-ffffffffffffffff"].state = "exited"
    registry.ended("p-ffffffffffffffff")
    registry.save()
    assert "p-ffffffffffffffff" in reg.Registry.load(tmp_path / "registry.json").entries
