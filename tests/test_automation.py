"""Schedules and hooks (supervisor/automation.py) in a real `supervisor up`:
a schedule's missed slots across a supervisor restart follow its policy
(skip or run once), under a fake clock the test moves (no sleeps); a fire is
never doubled by a further restart; a hook posts once per event to an HTTP
server of the test, retried after a 500, and a hook command runs in procs'
sandbox. A pipeline schedule starts its runner (backend `pipeline`) once, also
when the supervisor stopped between the fire's fact and the start. The cron
walk itself is checked as a pure function."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from actors.registries.entries import ScheduleEntry
from actors.writer.client import WriterClient
from broker.errors import RequestTimeoutError
from broker.statedir import StateDir
from supervisor.automation import ENV_CLOCK_OFFSET_FILE, ENV_HOLD_SPAWNS, due_slots
from tests.agentkit import write_task
from tests.processes import ProcessTracker, wait_for
from tests.test_pipelines_process import HELLO
from tests.test_supervisor_process import cli
from tests.test_supervisor_run import fast_config, supervisor_up


def _entry(missed: str) -> ScheduleEntry:
    return ScheduleEntry(name="s", cron="*/10 * * * *", task="/t.yaml", missed=missed)  # type: ignore[arg-type]


def test_due_slots_fire_live_slots_and_apply_the_missed_policy() -> None:
    t0 = 1_800_000_000.0  # a multiple of 600: a slot of */10
    assert due_slots(_entry("skip"), t0, t0 + 599, 60).fire is None
    live = due_slots(_entry("skip"), t0, t0 + 601, 60)
    assert (live.fire, live.catchup, live.skipped) == (t0 + 600, False, [])
    # three slots passed while down (the newest 5 minutes ago: older than the grace)
    once = due_slots(_entry("run_once"), t0, t0 + 2100, 60)
    assert (once.fire, once.catchup, once.missed, once.skipped) == (t0 + 1800, True, 3, [])
    skip = due_slots(_entry("skip"), t0, t0 + 2100, 60)
    assert skip.fire is None and skip.skipped == [t0 + 600, t0 + 1200, t0 + 1800]
    # missed ones and a live one: skip records the missed, the live one fires
    both = due_slots(_entry("skip"), t0, t0 + 1801, 60)
    assert both.fire == t0 + 1800 and both.skipped == [t0 + 600, t0 + 1200]


@pytest.fixture
def writer(state_dir: StateDir) -> Iterator[WriterClient]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = WriterClient(ctx, state_dir, "operator", timeout_s=1.0, retries=1)
    yield client
    client.close()
    ctx.destroy(linger=0)


def _facts(writer: WriterClient, stream: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        return [(r.event, r.payload()) for r in writer.read_stream(stream)]  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - the writer is not up (between two supervisors)
        return []


def _config(state_dir: StateDir, *kinds: str) -> Path:
    """The fast configuration with only the children of `kinds` besides the core."""
    path = fast_config(state_dir)
    config = yaml.safe_load(path.read_text())
    config["automation"] = {"tick_s": 0.05, "catchup_grace_s": 60}
    config["children"] = [c for c in config["children"]
                          if c["kind"] in ("writer", "broker", *kinds)]
    path.write_text(yaml.safe_dump(config))
    return path


def _apply(processes: ProcessTracker, state_dir: StateDir, op: str, entry: Any) -> None:
    """A registry op as the operator runs it (`supervisor registry apply`)."""
    done = cli(processes, state_dir, "registry", "apply", op, "--args",
               json.dumps({"entry": entry}))
    assert done.returncode == 0, done.stderr


def _stop(processes: ProcessTracker, state_dir: StateDir, up: Any) -> None:
    assert cli(processes, state_dir, "stop").returncode == 0
    assert up.wait(timeout=30) == 0


@pytest.mark.timeout(150)  # two supervisor starts and stops, an agent: slow on a loaded host
def test_a_schedule_fires_across_a_supervisor_restart_by_its_missed_policy(
        processes: ProcessTracker, state_dir: StateDir, writer: WriterClient) -> None:
    config = _config(state_dir)
    clock = state_dir.root.parent / "clock-offset"
    clock.write_text("0")
    env = {ENV_CLOCK_OFFSET_FILE: str(clock)}
    task = write_task(state_dir.root.parent / "quick.yaml", [{"op": "finish", "summary": "ok"}])
    entries = [{"name": "once", "cron": "*/10 * * * *", "task": str(task), "missed": "run_once"},
               {"name": "skip", "cron": "*/10 * * * *", "task": str(task), "missed": "skip"}]

    def facts(event: str, schedule: str) -> list[dict[str, Any]]:
        return [p for e, p in _facts(writer, "automation/schedules")
                if e == event and p["schedule"] == schedule]

    up = supervisor_up(processes, state_dir, config, "up1", env)
    for entry in entries:
        _apply(processes, state_dir, "schedule_add", entry)
    wait_for(lambda: facts("schedule_armed", "once") and facts("schedule_armed", "skip"), 20,
             "both schedules armed")
    armed = facts("schedule_armed", "once")[0]["since"]
    assert facts("schedule_fired", "once") == []  # nothing due yet
    # the clock reaches the next slot while it runs: both fire on time, once each
    first_slot = (armed // 600 + 1) * 600
    clock.write_text(repr(first_slot + 0.2 - time.time()))
    wait_for(lambda: facts("schedule_fired", "once") and facts("schedule_fired", "skip"), 20,
             "the live slot")
    live = facts("schedule_fired", "skip")[0]
    assert (live["slot"], live["catchup"]) == (first_slot, False)
    agent = facts("schedule_fired", "once")[0]["agent"]

    def ended(name: str) -> bool:
        return any(e == "session_exit" and p.get("reason") == "finished"
                   for e, p in _facts(writer, f"agent/{name}"))

    wait_for(lambda: ended(agent), 30, f"the scheduled agent {agent} to run its task")
    _stop(processes, state_dir, up)

    # 25 minutes pass while the supervisor is down: two slots of */10; the first
    # pass after the restart applies both policies
    clock.write_text(repr(first_slot + 1500 - time.time()))
    up = supervisor_up(processes, state_dir, config, "up2", env)
    wait_for(lambda: len(facts("schedule_fired", "once")) == 2
             and facts("schedule_skipped", "skip"), 20, "the pass after the restart")
    fired = facts("schedule_fired", "once")
    assert len(fired) == 2 and fired[1]["catchup"] is True  # one run for both missed slots
    assert (fired[1]["slot"], fired[1]["missed"]) == (first_slot + 1200, 2)
    skipped = facts("schedule_skipped", "skip")
    assert len(skipped) == 1 and skipped[0]["count"] == 2
    assert len(facts("schedule_fired", "skip")) == 1  # the first slot never fires twice
    _stop(processes, state_dir, up)


@pytest.mark.timeout(150)  # two supervisor starts and stops, a runner: slow on a loaded host
def test_a_pipeline_schedule_starts_its_runner_once_across_a_restart_after_the_fact(
        processes: ProcessTracker, state_dir: StateDir, writer: WriterClient,
        tmp_path: Path) -> None:
    from actors.agent import catalog
    from actors.pipelines import report

    catalog.install()  # report reads the run's pipeline, whose steps name ops

    config = _config(state_dir)
    clock = tmp_path / "clock-offset"
    clock.write_text("0")
    env = {ENV_CLOCK_OFFSET_FILE: str(clock)}
    # the fault: the supervisor takes no spawn order, as if it died after the fact
    up = supervisor_up(processes, state_dir, config, "up1", {**env, ENV_HOLD_SPAWNS: "1"})
    source = tmp_path / "hello.yaml"
    source.write_text(HELLO)
    installed = cli(processes, state_dir, "registry", "apply", "pipeline_install",
                    "--args", json.dumps({"path": str(source)}))
    assert installed.returncode == 0, installed.stderr
    for entry in [{"name": "greet", "cron": "*/10 * * * *", "action": "pipeline",
                   "pipeline": "hello", "inputs": {"who": "cron"}},
                  {"name": "ghost", "cron": "*/10 * * * *", "action": "pipeline",
                   "pipeline": "nope"}]:
        _apply(processes, state_dir, "schedule_add", entry)

    def fired(schedule: str) -> list[dict[str, Any]]:
        return [p for e, p in _facts(writer, "automation/schedules")
                if e == "schedule_fired" and p["schedule"] == schedule]

    def armed() -> list[dict[str, Any]]:
        return [p for e, p in _facts(writer, "automation/schedules") if e == "schedule_armed"]

    wait_for(lambda: len(armed()) == 2, 20, "both schedules armed")
    slot = (max(p["since"] for p in armed()) // 600 + 1) * 600
    clock.write_text(repr(slot + 0.2 - time.time()))
    wait_for(lambda: fired("greet") and fired("ghost"), 20, "the slot")
    fact = fired("greet")[0]
    runner = fact["runner"]
    assert (fact["started"], fact["backend"], fact["slot"]) == (True, "pipeline", slot)
    assert runner == fact["agent"] == "greet-" + time.strftime("%Y%m%d%H%M%S",
                                                               time.gmtime(slot))
    refused = fired("ghost")[0]  # an unknown pipeline: recorded, never started
    assert refused["started"] is False and "no installed pipeline 'nope'" in refused["reason"]
    spec = state_dir.config_dir / "agents" / f"{runner}.json"
    assert not spec.exists()  # the fact is there, the start is not
    _stop(processes, state_dir, up)

    up = supervisor_up(processes, state_dir, config, "up2", env)

    def outcome() -> dict[str, Any] | None:
        try:
            return report.outcome(writer, state_dir, runner)
        except RequestTimeoutError:  # a loaded host: the writer's answer came late
            return None

    wait_for(lambda: outcome() is not None, 60,
             f"the runner {runner} started after the restart to end")
    done = report.outcome(writer, state_dir, runner)
    assert done is not None and done["status"] == "ok"
    assert done["outputs"] == {"bytes": len("hello cron")}
    workspace = state_dir.agent_dir(runner) / "workspace"
    assert (workspace / "hello.txt").read_text() == "hello cron"
    # started once: one greet call in the runner's stream, one fire of the slot
    greets = [p for e, p in _facts(writer, f"agent/{runner}")
              if e == "tool_start" and p.get("op") == "write_file"]
    assert len(greets) == 1
    assert len(fired("greet")) == 1 and len(fired("ghost")) == 1
    assert [f.name for f in (state_dir.config_dir / "agents").glob("ghost-*")] == []
    _stop(processes, state_dir, up)


class _Notifier(BaseHTTPRequestHandler):
    """Answers 500 to the first POST of each idempotency key, 200 after."""

    seen: list[dict[str, Any]]
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            first = not any(b["id"] == body["id"] for b in self.seen)
            self.seen.append(body)
        self.send_response(500 if first else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        return


@pytest.mark.timeout(120)
def test_hooks_post_once_per_event_after_a_500_and_run_commands_in_the_sandbox(
        processes: ProcessTracker, state_dir: StateDir, writer: WriterClient) -> None:
    _Notifier.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Notifier)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/notify"
        root = state_dir.root
        up = supervisor_up(processes, state_dir, _config(state_dir, "procs"), "up",
                 {"OPENAI_API_KEY": "sk-hook-test-key"})
        for hook in [
            {"name": "notify", "on": ["agent_finished", "approval_requested"], "url": url,
             "retries": 3, "backoff_s": 0.05, "timeout_s": 5},
            {"name": "script", "on": ["agent_finished"], "timeout_s": 20,
             "command": f'printf %s "$CORRAL_HOOK_EVENT" > event.json; '
                        f'ls -A {root} > statedir.txt; echo "$OPENAI_API_KEY" > key.txt'},
            {"name": "outside", "on": ["agent_finished"], "url": "http://192.0.2.1:9/x",
             "retries": 0},
        ]:
            _apply(processes, state_dir, "hook_add", hook)
        task = write_task(state_dir.root.parent / "ask.yaml", [
            {"op": "ask", "question": "ship it?"}, {"op": "finish", "summary": "done"}])
        assert cli(processes, state_dir, "spawn", "worker", "--task", str(task)).returncode == 0

        def outcomes() -> dict[str, tuple[str, dict[str, Any]]]:
            return {p["delivery"]: (e, p) for e, p in _facts(writer, "automation/hooks")
                    if e in ("hook_delivered", "hook_failed")}

        wait_for(lambda: len(outcomes()) == 1, 30, "the approval hook delivered")
        assert cli(processes, state_dir, "answer", "worker", "req-1.0", "yes").returncode == 0
        wait_for(lambda: len(outcomes()) == 4, 40, "every hook's outcome")
        done = outcomes()
        by_hook = {p["hook"] + "/" + p["event"]: (e, p) for e, p in done.values()}
        event, posted = by_hook["notify/agent_finished"]
        assert event == "hook_delivered" and posted["attempts"] == 2  # a 500, then 200
        assert by_hook["notify/approval_requested"][0] == "hook_delivered"
        assert by_hook["script/agent_finished"][0] == "hook_delivered"
        refused = by_hook["outside/agent_finished"]
        assert refused[0] == "hook_failed" and "neither loopback" in refused[1]["error"]
        # once per event: each delivery id was posted twice (500, then 200), no more
        ids = [b["id"] for b in _Notifier.seen]
        assert sorted(ids) == sorted(2 * [d for d in done if d.startswith("notify:")])
        finished = next(b for b in _Notifier.seen if b["event"] == "agent_finished")
        assert finished["agent"] == "worker" and finished["detail"]["reason"] == "finished"
        # the command ran in procs' sandbox: state directory hidden, no model key
        workspace = state_dir.agent_dir("automation") / "workspace"
        ran = json.loads((workspace / "event.json").read_text())
        assert ran["event"] == "agent_finished" and ran["agent"] == "worker"
        # only the way down to its own workspace is there: no keys, no WAL
        assert (workspace / "statedir.txt").read_text().split() == ["agents"]
        assert (workspace / "key.txt").read_text().strip() == ""
        _stop(processes, state_dir, up)
        assert len(_Notifier.seen) == len(ids)  # nothing delivered again at the stop
    finally:
        server.shutdown()
        server.server_close()


def test_every_hook_event_comes_from_its_fact() -> None:
    """The WAL records (and the supervisor's give-up) each hook event is made of."""
    from supervisor.automation import events_of, loopback_or_allowed

    def kind(stream: str, event: str, payload: Any) -> str | None:
        found = events_of(stream, event, 7, 1.0, payload)
        return None if found is None else found.event

    assert kind("agent/a", "approval_requested", {"request": "req-1.0"}) == "approval_requested"
    assert kind("agent/a", "session_exit", {"reason": "finished"}) == "agent_finished"
    assert kind("agent/a", "session_exit", {"reason": "max_turns"}) == "agent_finished"
    assert kind("agent/a", "session_exit", {"reason": "budget"}) == "budget_paused"
    assert kind("subagents/a", "subagent_ended", {"status": "ok"}) == "changeset_ready"
    assert kind("agent/a", "tool_result", {"status": "ok"}) is None
    assert kind("agent/a", "session_exit", ["not", "a", "map"]) is None
    assert kind("procs/a", "subagent_ended", {}) is None
    assert loopback_or_allowed("http://127.0.0.2:9/x", []) is None
    assert loopback_or_allowed("http://[::1]:9/x", []) is None
    assert loopback_or_allowed("http://hooks.example:9/x", ["hooks.example"]) is None
    assert loopback_or_allowed("http://10.0.0.1/x", []) is not None
    assert loopback_or_allowed("http://localhost.evil.example/x", []) is not None


def test_a_run_of_an_agents_schedule_gets_what_is_left_and_is_charged_to_it(
        state_dir: StateDir) -> None:
    """The grant of an agent's schedule (supervisor/automationgrants.py): the
    run's budget is what is left of its owner's, none left refuses it; an
    ended run's use is charged to the owner once, and the owner's fold counts
    it. Over the in-memory writer."""
    from actors.kernel.settings import AgentSettings, AgentSpec, Budget, write_spec
    from actors.sessions.rebuild import rebuild
    from supervisor.automationgrants import Charges, Grant, GrantRefusedError, grant_for
    from tests.agentkit import FakeWriter

    writer = FakeWriter()
    write_spec(state_dir, "owner", AgentSpec(task="/t.yaml", settings=AgentSettings(
        budget=Budget(tokens=100, cost_units=None))))
    owner = writer.as_origin("owner")
    owner.append("agent/owner", "turn", {"turn": 1, "usage": {"tokens_in": 30,
                                                              "tokens_out": 10}}, key="t1")
    assert grant_for(writer, state_dir, "operator") == Grant()  # type: ignore[arg-type]
    grant = grant_for(writer, state_dir, "owner")  # type: ignore[arg-type]
    assert grant == Grant("owner", {"tokens": 60, "cost_units": None})
    for refused, why in ((None, "no owner"), ("gone", "no spec")):
        with pytest.raises(GrantRefusedError, match=why):
            grant_for(writer, state_dir, refused)  # type: ignore[arg-type]

    charges = Charges(state_dir)
    charges.fired({"schedule": "s", "agent": "s-1", "started": True, "creator": "owner"})
    charges.fired({"schedule": "op", "agent": "op-1", "started": True, "creator": None})
    run = writer.as_origin("s-1")
    run.append("agent/s-1", "turn", {"turn": 1, "usage": {"tokens_in": 50,
                                                          "tokens_out": 20}}, key="t1")
    charges.tick(writer)  # type: ignore[arg-type]
    assert writer.events("agent/owner")[-1][0] == "turn"  # not ended yet: not charged
    run.append("agent/s-1", "session_exit", {"reason": "finished"}, key="x")
    charges.tick(writer)  # type: ignore[arg-type]
    charges.tick(writer)  # type: ignore[arg-type]
    usage = [p for e, p in writer.events("agent/owner") if e == "schedule_usage"]
    assert usage == [{"run": "s-1", "schedule": "s", "tokens": 70, "cost_units": 0.0}]
    assert [e for e, _ in writer.events("automation/schedules")] == ["schedule_charged"]
    assert rebuild(writer, state_dir, "owner").state.budget.tokens_used == 110  # type: ignore[arg-type]
    with pytest.raises(GrantRefusedError, match="budget: owner has no budget left"):
        grant_for(writer, state_dir, "owner")  # type: ignore[arg-type]
