"""The soak's moving parts: control line, approver, killer, sampling, orphan sweep.

See docs/soak.md ("What it does").
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

import psutil

from actors.writer.wal import list_segments, parse_record
from broker import protocol
from broker.statedir import StateDir

MARKER_ENV = "CORRAL_SOAK_ID"
LONG_LIVED = ("supervisor", "writer", "broker", "procs", "subagents")


@dataclass
class Cut:
    """A cut of the active WAL segment made while the writer was down."""

    at: float  # unix time of the cut
    first_seq: int  # the record the cut went through (it and all after are gone)
    head_seq: int  # the head before the cut
    streams: list[str]


@dataclass
class Run:
    kills: dict[str, int] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    status_failures: int = 0
    started_at: float = 0.0


class Control:
    """The soak's line to the supervisor's control socket (one context, reused)."""

    def __init__(self, state_dir: StateDir) -> None:
        import zmq

        from broker.requester import Requester

        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._req = Requester(self.ctx, state_dir.endpoint("supervisor"))

    def children(self, timeout_s: float = 2.0) -> list[protocol.ChildStatus] | None:
        """The supervisor's children, or None when it does not answer."""
        from broker.errors import CorralError
        from broker.requester import new_msg_id

        try:
            reply = self._req.request(
                protocol.StatusRequest(msg_id=new_msg_id("soak")), timeout_s=timeout_s, retries=1
            )
        except CorralError:
            return None
        return reply.children if isinstance(reply, protocol.StatusReply) else None

    def close(self) -> None:
        self._req.close()
        self.ctx.destroy(linger=0)


class Approver:
    """Answers every approval request, as an operator would, through the same
    code as `supervisor approve`: it follows the approvals ledger for requests
    and rebuilds only the agents that have one pending."""

    def __init__(self, state_dir: StateDir, control: Control) -> None:
        from actors.writer.client import WriterClient

        self.state_dir = state_dir
        self._writer = WriterClient(control.ctx, state_dir, "operator", timeout_s=1, retries=3)
        self._offset = 0
        self._pending: set[tuple[str, str]] = set()
        self.answered = 0

    def tick(self) -> None:
        from actors.sessions.rebuild import rebuild
        from broker.errors import CorralError
        from supervisor.cli.agents import answer_approval

        path = self.state_dir.approvals_ledger_path
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines(keepends=True):
            record = parse_record(line)
            if record is None or not record.stream.startswith("agent/"):
                continue
            agent = record.stream.removeprefix("agent/")
            payload = record.payload()
            request = str(payload.get("request")) if isinstance(payload, dict) else ""
            if record.event == "approval_requested":
                self._pending.add((agent, request))
            elif record.event == "approval_answer":
                self._pending.discard((agent, request))
        for agent, request in sorted(self._pending):
            try:
                state = rebuild(self._writer, self.state_dir, agent).state
                approval = state.approvals.get(request)
                if approval is None:
                    continue  # the ledger line is visible before the stream serves it
                if approval.status != "pending":
                    self._pending.discard((agent, request))
                    continue
                answer_approval(
                    self._writer,
                    agent,
                    state,
                    request,
                    decision="approve",
                    always=False,
                    note="soak",
                )
                self.answered += 1
            except LookupError:
                self._pending.discard((agent, request))
            except CorralError:
                return  # the writer is down (being killed): try again next tick

    def close(self) -> None:
        self._writer.close()


@dataclass(frozen=True)
class CutBudget:
    """How many of the soak's agents (`agents`, their names: the origins of
    their appends) the cuts may reach in all. An agent one of whose
    acknowledged appends a cut took is exempt from the agent-level checks
    (ops/soakcheck.py, cut_victims), which need the rest."""

    agents: frozenset[str]
    max_reached: int


def _cut_tail(
    state_dir: StateDir,
    rng: random.Random,
    budget: CutBudget | None = None,
    reached: set[str] | None = None,
) -> Cut | None:
    """Cut the active segment at a random byte of one of its last 3 records
    (a torn write; the newest are often not yet acknowledged, older ones were).
    No cut (None) when the records it would take were appended by more of
    `budget`'s agents than it allows, with those the earlier cuts reached
    (`reached`, which a cut made adds its own to)."""
    segments = list_segments(state_dir.wal_dir)
    if not segments:
        return None
    path = segments[-1][1]
    size = path.stat().st_size
    window = min(size, 1 << 20)
    with open(path, "rb") as f:
        f.seek(size - window)
        tail = f.read()
    ends = [i + 1 for i, b in enumerate(tail) if b == 0x0A]
    if len(ends) < 2:
        return None
    bounds = list(zip(ends[-4:-1], ends[-3:], strict=True))  # (start, end) of the last 3
    records = [parse_record(tail[a:b]) for a, b in bounds]
    victim = rng.randrange(len(bounds))
    gone = [r for r in records[victim:] if r is not None]
    if not gone:
        return None
    # start-up cuts a torn batch whole (docs/wal.md): the victim's batch-mates go too
    lines = zip([0, *ends[:-1]], ends, strict=True)
    in_window = (parse_record(tail[a:b]) for a, b in lines)
    gone = [r for r in in_window if r is not None and r.seq >= gone[0].batch_first]
    if budget is not None:
        now = (reached or set()) | ({r.origin for r in gone} & budget.agents)
        if len(now) > budget.max_reached:
            return None
        if reached is not None:
            reached |= now
    start, end = bounds[victim]
    cut_at = size - window + rng.randrange(start, end)
    with open(path, "r+b") as f:
        f.truncate(cut_at)
        os.fsync(f.fileno())
    return Cut(
        at=time.time(),
        first_seq=gone[0].seq,
        head_seq=gone[-1].seq,
        streams=sorted({r.stream for r in gone}),
    )


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.002)


def _sample_rss(run: Run, supervisor: psutil.Process) -> None:
    try:
        procs = [supervisor, *supervisor.children(recursive=False)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            name = (
                "supervisor"
                if proc.pid == supervisor.pid
                else proc.environ().get("CORRAL_ACTOR", "")
            )
            if name not in LONG_LIVED and not name.startswith("zygote"):
                continue
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        run.peak_rss_mib[name] = round(max(run.peak_rss_mib.get(name, 0.0), rss), 1)


def kill_loop(  # noqa: PLR0917 - the soak's parts, wired once
    state_dir: StateDir,
    control: Control,
    approver: Approver,
    supervisor: subprocess.Popen[bytes],
    run: Run,
    rng: random.Random,
    duration_s: float,
    interval_s: float,
    cut_chance: float,
    cut_budget: CutBudget | None = None,
) -> None:
    """Kill a random child every interval until the duration is over; a
    writer's kill cuts the WAL's tail at `cut_chance`, within `cut_budget`."""
    reached: set[str] = set()  # the budget's agents the cuts so far reached
    sup = psutil.Process(supervisor.pid)
    deadline = time.monotonic() + duration_s
    next_kill = time.monotonic() + interval_s
    next_sample = 0.0
    while time.monotonic() < deadline:
        if supervisor.poll() is not None:
            raise RuntimeError(
                f"the supervisor exited with {supervisor.returncode} during the soak"
            )
        now = time.monotonic()
        if now >= next_sample:
            _sample_rss(run, sup)
            approver.tick()
            next_sample = now + 1.0
        # pacing the fault injection, not waiting for a condition
        time.sleep(max(0.0, next_kill - time.monotonic()))
        next_kill += interval_s
        children = control.children()
        if children is None:
            run.status_failures += 1
            continue
        # any running child, whatever its kind, is as likely to be hit: a
        # writer or broker down for most of the run would measure only restarts
        live = sorted((c for c in children if c.pid and c.state == "running"), key=lambda c: c.name)
        if not live:
            continue
        target = rng.choice(live)
        kind = target.kind
        pid = int(target.pid or 0)
        if kind == "writer" and rng.random() < cut_chance:
            # hold the supervisor still so the writer stays down while we cut
            os.kill(supervisor.pid, signal.SIGSTOP)
            try:
                kill_group(pid)
                _wait_gone(pid, 5.0)
                cut = _cut_tail(state_dir, rng, cut_budget, reached)
            finally:
                os.kill(supervisor.pid, signal.SIGCONT)
            if cut is not None:
                run.cuts.append(cut)
                # the agents whose acknowledged facts were cut must rebuild from the WAL
                for child in live:
                    if child.kind == "agent" and f"agent/{child.name}" in cut.streams:
                        kill_group(int(child.pid or 0))
                        run.kills["agent"] = run.kills.get("agent", 0) + 1
        else:
            kill_group(pid)
        run.kills[kind] = run.kills.get(kind, 0) + 1


def wait_runtime_up(control: Control, supervisor: subprocess.Popen[bytes], output: str,
                    timeout_s: float = 120.0) -> None:
    """Until every child but the agents runs; RuntimeError with the end of the
    supervisor's `output` file if it exits or the deadline passes."""
    started = time.monotonic()
    while True:
        children = control.children(timeout_s=0.5)
        if children and all(c.state == "running" for c in children if c.kind != "agent"):
            return
        if supervisor.poll() is not None or time.monotonic() - started > timeout_s:
            with open(output, encoding="utf-8", errors="replace") as f:
                raise RuntimeError("the runtime did not come up: " + f.read()[-2000:])
        time.sleep(0.1)


def wait_agents_finished(
    control: Control, approver: Approver, expected: set[str], timeout_s: float
) -> int:
    """Wait until every expected agent exited 0 (finished); return how many did."""
    deadline = time.monotonic() + timeout_s
    finished = 0
    while time.monotonic() < deadline:
        approver.tick()
        children = control.children()
        if children is not None:
            done = {
                c.name
                for c in children
                if c.kind == "agent" and c.state == "exited" and c.last_exit == "exit 0"
            }
            finished = len(done & expected)
            if finished >= len(expected):
                return finished
        time.sleep(0.5)
    return finished


def orphans(marker: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER_ENV) == marker:
                found.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
                proc.kill()
        except (psutil.Error, OSError):
            continue
    return found
