"""The liveness rules as units: the pulse's watchdog rule and its thread (on a
real ROUTER socket), the supervisor's gap detector and silence clock, the
busy column of `supervisor status`, the configuration's consistency checks,
and the model call's own deadline against a server that trickles its answer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import zmq
import zmq.utils.monitor

from actors.agent.openai_backend import ModelTimeoutError, OpenAIModel
from actors.kernel.settings import OpenAISettings, Task
from actors.kernel.state import AgentState
from broker import protocol
from broker.control import Call, ControlReporter, shows_life
from broker.errors import ConfigError
from supervisor import config as supconfig
from supervisor.cli import statusview
from supervisor.config import ChildSpec
from supervisor.runtime.children import Child
from supervisor.runtime.monitor import GapDetector, overdue
from tests.processes import wait_for


# --- the watchdog rule -------------------------------------------------------------
def test_a_main_thread_that_touched_recently_shows_life() -> None:
    assert shows_life(10.0, last_touch=9.5, calls=(), stall_s=1.0)
    assert not shows_life(10.0, last_touch=8.0, calls=(), stall_s=1.0)


def test_a_call_within_its_deadline_and_grace_shows_life_past_it_does_not() -> None:
    call = Call("bash", since=0.0, until=30.0)
    assert shows_life(25.0, last_touch=0.0, calls=(call,), stall_s=1.0)  # slow, not hung
    assert shows_life(30.9, last_touch=0.0, calls=(call,), stall_s=1.0)  # grace to end it
    assert not shows_life(31.1, last_touch=0.0, calls=(call,), stall_s=1.0)  # hung


# --- the pulse thread, on a real socket ------------------------------------------------
Router = tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], str]


@pytest.fixture
def router(tmp_path: Any) -> Iterator[Router]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/sup.sock"
    sock.bind(endpoint)
    yield ctx, sock, endpoint
    sock.close()
    ctx.destroy(linger=0)


def _drain(sock: zmq.Socket[bytes]) -> list[protocol.Message]:
    out = []
    while sock.poll(0):
        _, frame = sock.recv_multipart()
        out.append(protocol.decode(frame))
    return out


def test_the_pulse_beats_while_the_main_thread_waits_in_a_call(
    router: Router,
) -> None:
    ctx, sock, endpoint = router
    reporter = ControlReporter(ctx, endpoint, "agent-1", 0.05, pulse=True, stall_s=0.2)
    try:
        reporter.ready()
        reporter.beat({"turn": 7})  # counters now; the pulse repeats them
        release = threading.Event()
        beats: list[protocol.Heartbeat] = []

        def busy_beat_seen() -> bool:
            beats.extend(m for m in _drain(sock) if isinstance(m, protocol.Heartbeat))
            return any(b.busy is not None and b.busy.since_s > 0.5 for b in beats)

        with reporter.busy("bash", 30.0):
            # the main thread is blocked in its call: a helper thread watches the socket
            watcher = threading.Thread(target=lambda: (wait_for(busy_beat_seen, 10,
                                                                "a busy heartbeat"),
                                                       release.set()))
            watcher.start()
            release.wait(15)  # the "call": blocks until the pulse has beaten through it
            watcher.join()
        busy = [b for b in beats if b.busy is not None]
        assert busy and {b.busy.op for b in busy if b.busy} == {"bash"}
        assert all(b.values == {"turn": 7} for b in busy)  # the last counters go along
        assert reporter.withheld == 0
    finally:
        reporter.close()


def test_the_pulse_stops_for_a_main_thread_stuck_outside_a_call_and_resumes(
    router: Router,
) -> None:
    ctx, sock, endpoint = router
    reporter = ControlReporter(ctx, endpoint, "procs", 0.05, pulse=True, stall_s=0.2)
    try:
        reporter.ready()
        # beats sent before the watchdog stepped in wait in the DEALER until its
        # connection is up, which a loaded machine can delay past the drain below:
        # read up to the Ready (the first frame) so none is still on its way
        got: list[protocol.Message] = []
        wait_for(lambda: (got.extend(_drain(sock)),
                          any(isinstance(m, protocol.Ready) for m in got))[1], 10, "ready")
        wait_for(lambda: reporter.withheld >= 3, 10, "beats withheld from a silent main thread")
        _drain(sock)
        withheld = reporter.withheld
        wait_for(lambda: reporter.withheld > withheld, 10, "another withheld beat")
        assert not [m for m in _drain(sock) if isinstance(m, protocol.Heartbeat)]
        reporter.touch()
        wait_for(lambda: any(isinstance(m, protocol.Heartbeat) for m in _drain(sock)), 10,
                 "beats again once the main thread shows life")
    finally:
        reporter.close()


def test_an_idle_main_thread_is_said_once_then_silent_and_its_wake_beats_at_once(
    router: Router,
) -> None:
    """Idle (docs/supervisor.md, "Liveness"): one beat with `idle`, then no
    beat at all while the main thread waits for work, however long; leaving
    the wait beats at once (without `idle`) and the beats resume."""
    ctx, sock, endpoint = router
    reporter = ControlReporter(ctx, endpoint, "agent-3", 0.05, pulse=True, stall_s=0.2)
    try:
        reporter.ready()
        got: list[protocol.Message] = []
        wait_for(lambda: (got.extend(_drain(sock)),
                          any(isinstance(m, protocol.Ready) for m in got))[1], 10, "ready")
        with reporter.idle():
            beats: list[protocol.Heartbeat] = []
            wait_for(lambda: (beats.extend(m for m in _drain(sock)
                                           if isinstance(m, protocol.Heartbeat)),
                              any(b.values.get("idle") == 1 for b in beats))[1],
                     10, "the idle beat")
            # many intervals and stall allowances: neither a beat nor a withheld one
            silent = threading.Event()
            assert not silent.wait(0.6)  # the fault is time passing: nothing may be sent
            assert not [m for m in _drain(sock) if isinstance(m, protocol.Heartbeat)]
            assert reporter.withheld == 0
        woke: list[protocol.Heartbeat] = []
        wait_for(lambda: (woke.extend(m for m in _drain(sock)
                                      if isinstance(m, protocol.Heartbeat)), len(woke) >= 2)[1],
                 10, "beats again after the wait")
        assert all("idle" not in b.values for b in woke)
    finally:
        reporter.close()


def test_an_idle_child_is_never_overdue_and_status_shows_it_idle() -> None:
    """Its liveness is its process (the supervisor reaps its exit): no beat
    deadline while idle; status shows a fresh heartbeat and `idle_s`. A beat
    without `idle` ends it, and the deadline is back."""
    child = _child()
    assert child.beat(1.0, {"pongs_total": 2, "idle": 1}, None)  # went idle: a change
    assert overdue(child, now=1_000.0, heartbeat_timeout_s=10.0) is None
    status = child.status(now=31.0)
    assert status.heartbeat_age_s == 0.0
    assert status.values["idle_s"] == 30.0 and status.busy is None
    text = statusview.render({"children": [status.model_dump(mode="json")],
                              "started_at": time.time()})
    assert "idle 30s" in text
    assert not child.beat(40.0, {"idle": 1}, None)  # still idle: no change
    assert child.status(now=41.0).values["idle_s"] == 40.0  # idle since the first
    assert child.beat(50.0, {"pongs_total": 3}, None)  # woke up
    assert "idle_s" not in child.status(now=51.0).values
    assert overdue(child, now=61.0, heartbeat_timeout_s=10.0) == "heartbeat"
    child.exited(None, 9, now=62.0)
    assert child.idle_at is None and child.heartbeat_age(62.0) is not None


def test_the_pulse_stops_for_a_call_far_past_its_deadline(
    router: Router,
) -> None:
    ctx, _, endpoint = router
    reporter = ControlReporter(ctx, endpoint, "agent-2", 0.05, pulse=True, stall_s=0.2)
    try:
        reporter.ready()
        with reporter.busy("model", 0.1):
            wait_for(lambda: reporter.withheld > 0, 10, "beats withheld from a hung call")
    finally:
        reporter.close()


def test_a_final_beat_leaves_before_the_pulse_closes(
    router: Router,
) -> None:
    ctx, sock, endpoint = router
    reporter = ControlReporter(ctx, endpoint, "agent-3", 10.0, pulse=True, stall_s=5)
    reporter.ready()
    reporter.beat({"phase": 3})
    reporter.close(linger_ms=500)
    got: list[protocol.Message] = []

    def final_beat_arrived() -> bool:
        # the two frames may reach the socket a poll apart: gather until the beat is here
        got.extend(_drain(sock))
        return any(isinstance(m, protocol.Heartbeat) and m.values == {"phase": 3}
                   for m in got)

    wait_for(final_beat_arrived, 5, "the final beat")
    assert isinstance(got[0], protocol.Ready)


def test_connect_makes_the_pulses_connection_before_ready_and_sends_only_after_it(
    router: Router,
) -> None:
    """An agent calls `connect()` as soon as its reporter exists: the pulse's
    connection (and its handshake) is made while the agent goes on starting,
    not after `ready()`; the first frame to arrive is still the Ready, and
    the beats follow it."""
    ctx, sock, endpoint = router
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    reporter = ControlReporter(ctx, endpoint, "agent-4", 0.05, pulse=True, stall_s=5)
    try:
        reporter.connect()
        assert monitor.poll(10_000), "no handshake before ready()"
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        reporter.ready()
        got: list[protocol.Message] = []
        wait_for(lambda: (got.extend(_drain(sock)),
                          any(isinstance(m, protocol.Heartbeat) for m in got))[1], 10,
                 "a beat after ready")
        assert isinstance(got[0], protocol.Ready)
    finally:
        reporter.close()
        sock.disable_monitor()
        monitor.close()


# --- the supervisor's side ----------------------------------------------------------------
def test_the_gap_detector_sees_a_stop_and_a_suspend() -> None:
    boot = [100.0]
    gaps = GapDetector(boottime=lambda: boot[0])
    assert gaps.gap(10.0, 2.0) is None  # first turn
    boot[0] += 0.1
    assert gaps.gap(10.1, 2.0) is None  # an ordinary turn
    boot[0] += 3.0
    assert gaps.gap(13.1, 2.0) == pytest.approx(3.0)  # SIGSTOP: both clocks ran
    boot[0] += 60.0  # suspend: CLOCK_MONOTONIC stood still, CLOCK_BOOTTIME did not
    assert gaps.gap(13.15, 2.0) == pytest.approx(60.0)
    boot[0] += 0.1
    assert gaps.gap(13.25, 2.0) is None
    boot[0] += 2.0
    assert gaps.gap(15.25, 10.0) is None  # under a 10 s timeout, 2 s is no gap (2.5 s is)


def _child(state: str = "running") -> Child:
    spec = ChildSpec(name="agent-1", kind="agent", ready_timeout_s=5.0)
    child = Child(spec=spec, policy=spec.policy())
    child.spawned(4242, now=0.0)
    child.state = state  # type: ignore[assignment]
    return child


def test_silence_before_the_supervisor_resumed_is_not_counted() -> None:
    child = _child()
    child.heartbeat_at = 1.0
    assert overdue(child, now=30.0, heartbeat_timeout_s=10.0) == "heartbeat"
    assert overdue(child, now=30.0, heartbeat_timeout_s=10.0, listening_since=29.0) is None
    assert overdue(child, now=40.0, heartbeat_timeout_s=10.0, listening_since=29.0) == "heartbeat"
    starting = _child("starting")
    assert overdue(starting, now=6.0, heartbeat_timeout_s=10.0) == "ready"
    assert overdue(starting, now=6.0, heartbeat_timeout_s=10.0, listening_since=5.0) is None


def test_status_shows_the_call_and_its_age_up_to_now() -> None:
    child = _child()
    child.heartbeat_at = 100.0
    child.busy = protocol.Busy(op="bash", since_s=12.0)
    status = child.status(now=103.5)
    assert status.busy == protocol.Busy(op="bash", since_s=15.5)
    text = statusview.render({"children": [status.model_dump(mode="json")],
                              "started_at": time.time()})
    assert "busy=bash 15s" in text
    decoded = protocol.decode(protocol.encode(protocol.Heartbeat(
        actor="agent-1", pid=1, busy=protocol.Busy(op="bash", since_s=1.5))))
    assert isinstance(decoded, protocol.Heartbeat) and decoded.busy is not None


# --- coherent defaults -----------------------------------------------------------------------
def _config(**sections: Any) -> dict[str, Any]:
    return {"children": [{"name": "writer", "kind": "writer"},
                         {"name": "broker", "kind": "broker"}], **sections}


def test_the_shipped_defaults_agree() -> None:
    config = supconfig.load(None)
    openai = config.agent.openai
    assert openai.call_deadline_s() <= config.agent.max_model_call_s
    assert config.heartbeat.timeout_s >= 3 * config.heartbeat.interval_ms / 1000


def test_a_heartbeat_timeout_shorter_than_three_beats_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"heartbeat: timeout_s 2 is shorter than 3 heartbeats"):
        supconfig.parse(_config(heartbeat={"interval_ms": 1000, "timeout_s": 2.0}), "c.yaml")


def test_a_model_call_longer_than_its_bound_is_refused() -> None:
    agent = {"openai": {"timeout_s": 60.0, "max_retries": 4}}  # the old defaults: 307.5 s
    with pytest.raises(ConfigError, match=r"307.5s, longer than agent.max_model_call_s 300"):
        supconfig.parse(_config(agent=agent), "c.yaml")
    agent["max_model_call_s"] = 310.0  # type: ignore[assignment]
    supconfig.parse(_config(agent=agent), "c.yaml")


# --- the model call's own deadline -------------------------------------------------------------
class _Trickle(BaseHTTPRequestHandler):
    """Answers 200 with a valid completion, one byte every 50 ms (about 6 s)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"choices": [{"message": {"content": "x" * 60}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for i in range(len(body)):
            try:
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.05)  # the fault: a server that trickles

    def log_message(self, *args: Any) -> None:
        pass


def test_a_trickling_model_server_is_cut_at_the_call_deadline() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        settings = OpenAISettings(base_url=f"http://127.0.0.1:{server.server_port}/v1",
                                  timeout_s=0.5, max_retries=1, backoff_base_s=0.1)
        model = OpenAIModel(settings, Task(prompt="p"), sleep=lambda _s: None)
        assert model.deadline_s == pytest.approx(1.1)
        started = time.monotonic()
        with pytest.raises(ModelTimeoutError, match="deadline"):
            model.next_reply(AgentState())
        # cut at the deadline, not at the trickle's end (~5 s): a loaded machine may
        # deliver the chunk that trips the check late, so the margin is generous
        assert time.monotonic() - started < model.deadline_s + 2.5
        assert model.attempts == 2  # each attempt cut at its timeout, then the call's deadline
    finally:
        server.shutdown()
        server.server_close()
