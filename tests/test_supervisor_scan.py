"""The supervisor's per-child scan (supervisor/runtime/scan.py `Scanner`): it runs at
most every SCAN_INTERVAL_S or at the next deadline, not on every loop turn
(a turn per heartbeat of 500 agents), and still restarts, kills and starts
on time; an agent queued again no longer counts among those starting."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from broker import protocol
from broker.statedir import StateDir
from supervisor.config import load
from supervisor.runtime import loop as runtime_module
from supervisor.runtime import starter as starter_module
from supervisor.runtime.control import Incoming
from supervisor.runtime.loop import Runtime
from supervisor.runtime.scan import SCAN_INTERVAL_S


@pytest.fixture
def runtime(state_dir: StateDir, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    rt = Runtime(load(None), state_dir)
    rt.phase = len(runtime_module.KIND_ORDER)  # started: no start phase moves
    rt.publisher.next_at = float("inf")  # no status file, no sampler
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(runtime_module.spawner, "signal_group",
                        lambda pid, sig: signals.append((pid, sig)) or True)
    rt.signals_sent = signals  # type: ignore[attr-defined]
    try:
        yield rt
    finally:
        rt.control.close()
        rt.ctx.destroy(linger=0)


def _started(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    started: list[str] = []
    monkeypatch.setattr(rt, "start", lambda child, now: started.append(child.name))
    return started


def test_a_turn_soon_after_a_scan_does_not_scan_again(runtime: Runtime,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[float] = []
    real = runtime.scanner.scan

    def counted(now: float, *args: Any, **kwargs: Any) -> None:
        scans.append(now)
        real(now, *args, **kwargs)

    monkeypatch.setattr(runtime.scanner, "scan", counted)
    runtime._advance(100.0)
    runtime._advance(100.0 + SCAN_INTERVAL_S / 2)
    assert scans == [100.0]
    assert runtime._timeout_ms(100.0 + SCAN_INTERVAL_S / 2) <= SCAN_INTERVAL_S * 500 + 1
    runtime._advance(100.0 + SCAN_INTERVAL_S)
    assert scans == [100.0, 100.0 + SCAN_INTERVAL_S]


def test_an_exit_restarts_on_the_next_turn_though_a_scan_just_ran(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first exit in the window restarts at once (no backoff): that must
    not wait for the next scan."""
    started = _started(runtime, monkeypatch)
    child = runtime.children["procs"]
    child.spawned(4242, now=100.0)
    child.state = "running"
    runtime._advance(100.0)  # a scan: the next one is SCAN_INTERVAL_S away
    runtime.after_exit(child, child.exited(1, None, 100.001), 100.001)
    assert child.state == "backoff" and child.restart_at == pytest.approx(100.001)
    assert runtime._timeout_ms(100.001) <= 1
    runtime._advance(100.002)
    assert started == ["procs"]


def test_a_backoff_restart_wakes_the_loop_at_its_time(runtime: Runtime,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    started = _started(runtime, monkeypatch)
    child = runtime.children["procs"]
    runtime._advance(100.0)
    child.state, child.restart_at = "backoff", 100.03
    runtime.scanner.at = 0.0  # as after_exit leaves it
    runtime.scanner.watch(child)  # as after_exit does: the scan visits the watched children
    runtime._advance(100.01)
    assert started == []
    assert runtime._timeout_ms(100.01) <= 21  # woken at 100.03, not at the next scan
    runtime._advance(100.03)
    assert started == ["procs"]


def test_a_stop_deadline_and_a_silent_child_are_killed_by_the_scan(runtime: Runtime) -> None:
    silent, stopping = runtime.children["procs"], runtime.children["subagents"]
    timeout_s = runtime.config.heartbeat.timeout_s
    silent.spawned(4242, now=100.0)
    runtime._on_message(Incoming(b"x", protocol.Heartbeat(actor="procs", pid=4242)), now=100.0)
    stopping.spawned(4343, now=100.0)
    stopping.state = "running"
    runtime._advance(100.0)
    runtime.terminate(stopping, 100.0)
    deadline = stopping.stop_deadline
    assert deadline is not None
    assert runtime._timeout_ms(deadline - 0.001) <= 2
    runtime._advance(deadline)
    assert (4343, signal.SIGKILL) in runtime.signals_sent  # type: ignore[attr-defined]
    assert (4242, signal.SIGKILL) not in runtime.signals_sent  # type: ignore[attr-defined]
    runtime._advance(100.0 + timeout_s + SCAN_INTERVAL_S + 0.01)
    assert (4242, signal.SIGKILL) in runtime.signals_sent  # type: ignore[attr-defined]


def test_a_ready_moves_the_start_phase_without_waiting_for_a_scan(state_dir: StateDir) -> None:
    """The phases move on the events that can move them (here a `ready`),
    not only at a scan."""
    rt = Runtime(load(None), state_dir)
    try:
        writer = rt.children["writer"]
        writer.spawned(4242, now=100.0)
        rt.phase = 0
        rt.publisher.next_at = float("inf")
        rt._advance(100.0)
        assert rt.phase == 0
        rt._on_message(Incoming(b"x", protocol.Ready(actor="writer", pid=4242)), now=100.001)
        started: list[str] = []
        rt.start = lambda child, now: started.append(child.name)  # type: ignore[method-assign]
        rt._advance(100.002)  # well within SCAN_INTERVAL_S of the last scan
        assert rt.phase == 1 and started == ["broker"]
    finally:
        rt.control.close()
        rt.ctx.destroy(linger=0)


def test_an_agent_queued_again_is_not_counted_as_starting(state_dir: StateDir) -> None:
    rt = Runtime(load(None), state_dir)
    try:
        rt.starter.use_zygote = True
        rt.starter.zygote = None
        from supervisor.config import ChildSpec
        from supervisor.runtime.children import Child

        names = [f"agent-{i}" for i in range(starter_module.AGENTS_STARTING)]
        for name in names:
            spec = ChildSpec(name=name, kind="agent", restart="transient")
            rt.children[name] = Child(spec=spec, policy=spec.policy())
            rt.children[name].fork_pending = True
            rt.starter.starting.add(name)
        assert not rt.starter.may_start_agent()
        rt.start(rt.children[names[0]], 100.0)  # back in the fork queue
        assert rt.starter.may_start_agent()
    finally:
        rt.control.close()
        rt.ctx.destroy(linger=0)
