"""The process skeleton (broker/skeleton.py): SIGTERM and SIGINT request a
stop and wake a poll, the close steps run last registered first whatever
the end, a known exception ends the process with its code (logged, one line
on stderr), any other is raised after the close steps; and a real process
built on it exits 0 on SIGTERM having closed in reverse order."""

from __future__ import annotations

import os
import select
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker import skeleton
from broker.errors import ConfigError, LockHeldError, StateDirError
from tests.processes import ProcessTracker, wait_for

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def handlers() -> Iterator[None]:
    """The signal handlers and wakeup fd as they were before the test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT,
                                                    signal.SIGCHLD)}
    yield
    signal.set_wakeup_fd(-1)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.usefixtures("handlers")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_requests_a_stop_and_wakes_the_poll(sig: int) -> None:
    asked: list[bool] = []
    stop = skeleton.Stop(lambda: asked.append(True), wakeup=True)
    assert not stop.stopped
    os.kill(os.getpid(), sig)
    wait_for(lambda: stop.stopped, 10, "the handler to run")
    assert asked == [True]
    readable, _, _ = select.select([stop.read_fd], [], [], 10)
    assert readable == [stop.read_fd]
    stop.drain()
    assert select.select([stop.read_fd], [], [], 0)[0] == []
    stop.close()
    assert stop.read_fd == -1
    assert signal.set_wakeup_fd(-1) == -1  # close() took the wakeup fd back


@pytest.mark.usefixtures("handlers")
def test_sigchld_wakes_the_poll_without_a_stop_and_close_restores_it() -> None:
    stop = skeleton.Stop(wakeup=True, children=True)
    os.kill(os.getpid(), signal.SIGCHLD)
    readable, _, _ = select.select([stop.read_fd], [], [], 10)
    assert readable == [stop.read_fd]
    assert not stop.stopped
    stop.close()
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL


def test_close_steps_run_last_registered_first_after_the_body() -> None:
    proc = skeleton.Process("t")
    order: list[str] = []
    proc.on_close(lambda: order.append("first registered"))

    def body() -> int:
        proc.on_close(lambda: order.append("registered in the body"))
        order.append("body")
        return 3

    assert proc.run(body) == 3
    assert order == ["body", "registered in the body", "first registered"]


class _Log:
    """Stands in for the process's logger: the calls it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def error(self, event: str, **fields: Any) -> None:
        self.calls.append(("error", event, fields))

    def exception(self, event: str, **fields: Any) -> None:
        self.calls.append(("exception", event, fields))


def test_a_known_exception_exits_with_its_code_logged_and_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    exits = (
        skeleton.Exit(LockHeldError, 75, "t_lock_held", "{exc}: another one holds it",
                      lambda exc: {"holder_pid": exc.pid}),
        skeleton.Exit(StateDirError, 78, "t_state_dir_unusable"),
        skeleton.Exit(OSError, 74, "t_io_failed", "I/O error: {exc}", lambda _exc: {},
                      traceback=True),
    )

    def fail(exc: BaseException) -> tuple[int, list[Any], str]:
        proc = skeleton.Process("t", exits)
        log = _Log()
        proc.log = log  # type: ignore[assignment]
        closed: list[str] = []
        proc.on_close(lambda: closed.append("closed"))
        code = proc.run(lambda: _raise(exc))
        assert closed == ["closed"]
        return code, log.calls, capsys.readouterr().err

    # the first entry that matches: a LockHeldError is a StateDirError
    assert fail(LockHeldError(Path("/run/x.lock"), 42)) == (
        75, [("error", "t_lock_held", {"holder_pid": 42})],
        "t: /run/x.lock is held by pid 42: another one holds it\n")
    assert fail(StateDirError("no room")) == (
        78, [("error", "t_state_dir_unusable", {"error": "no room"})], "t: no room\n")
    assert fail(OSError(5, "EIO")) == (
        74, [("exception", "t_io_failed", {})], "t: I/O error: [Errno 5] EIO\n")


def test_the_log_line_names_the_event_and_its_fields() -> None:
    proc = skeleton.Process("t", (skeleton.Exit(ConfigError, 78, "t_refused"),))
    log = _Log()
    proc.log = log  # type: ignore[assignment]
    assert proc.run(lambda: _raise(ConfigError("bad key"))) == 78
    assert log.calls == [("error", "t_refused", {"error": "bad key"})]


def test_before_logging_is_set_up_a_refusal_is_only_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    proc = skeleton.Process("t")  # CONFIG_EXITS
    assert proc.log is None
    assert proc.run(lambda: _raise(ConfigError("bad key"))) == skeleton.EXIT_CONFIG
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "t: bad key\n")


def test_an_unknown_exception_is_raised_after_the_close_steps() -> None:
    proc = skeleton.Process("t")
    order: list[str] = []
    proc.on_close(lambda: order.append("closed"))
    with pytest.raises(ZeroDivisionError):
        proc.run(lambda: 1 // 0)
    assert order == ["closed"]


def _raise(exc: BaseException) -> int:
    raise exc


CHILD = textwrap.dedent("""
    import sys, select
    from broker import skeleton

    proc = skeleton.Process("child")

    def body() -> int:
        stop = proc.stop_on_signals(wakeup=True)
        proc.on_close(lambda: print("closed a", flush=True))
        proc.on_close(lambda: print("closed b", flush=True))
        print("ready", flush=True)
        while not stop.stopped:
            select.select([stop.read_fd], [], [], 1.0)
        print("stopping", flush=True)
        return 0

    sys.exit(proc.run(body))
""")


@pytest.mark.process
def test_sigterm_ends_a_real_process_with_0_and_its_steps_in_reverse(
        processes: ProcessTracker) -> None:
    child = processes.spawn(["-c", CHILD], name="skeleton-child")
    wait_for(lambda: "ready" in processes.output("skeleton-child"), 20, "the child to start")
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=20) == 0
    assert processes.output("skeleton-child").split() == [
        "ready", "stopping", "closed", "b", "closed", "a"]
