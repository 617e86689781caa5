"""The supervisor's resource samples (supervisor/runtime/sampling.py): USS reads are
bounded per pass (the never-read first, then round robin, within a time
budget), a gone pid is skipped, and the thread hands back what it sampled."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from supervisor.config import ChildSpec
from supervisor.runtime.children import Child
from supervisor.runtime.sampling import Sample, Sampler, SamplerThread, apply_samples
from tests.processes import wait_for


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def _with_uss(samples: dict[int, Sample]) -> set[int]:
    return {pid for pid, s in samples.items() if s.uss_bytes is not None}


def test_uss_is_read_for_at_most_uss_per_pass_children_never_read_first(sleeper: int) -> None:
    me = os.getpid()
    sampler = Sampler(uss_per_pass=1)
    first = sampler.sample([me, sleeper])
    assert set(first) == {me, sleeper}  # CPU and RSS for every child, each pass
    assert all(s.rss_bytes > 0 for s in first.values())
    assert _with_uss(first) == {me}  # one USS read: the first never read
    assert _with_uss(sampler.sample([me, sleeper])) == {sleeper}  # then the other
    later = [_with_uss(sampler.sample([me, sleeper])) for _ in range(4)]
    assert all(len(turn) == 1 for turn in later)
    assert set().union(*later) == {me, sleeper}  # round robin: both come up again


def test_no_uss_read_past_the_budget_and_a_gone_pid_is_skipped(sleeper: int) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    sampler = Sampler(uss_per_pass=10, uss_budget_s=0.0)
    got = sampler.sample([os.getpid(), sleeper, dead.pid])
    assert set(got) == {os.getpid(), sleeper}
    assert _with_uss(got) == set()


def test_the_thread_samples_the_submitted_pids_and_figures_go_to_the_child_with_the_pid(
    sleeper: int,
) -> None:
    thread = SamplerThread()
    try:
        thread.submit([sleeper])
        got = wait_for(thread.take, 20, "a finished pass")
    finally:
        thread.close()
    assert set(got) == {sleeper} and got[sleeper].uss_bytes is not None
    spec = ChildSpec(name="agent-1", kind="agent", ready_timeout_s=5.0)
    child, other = Child(spec=spec, policy=spec.policy()), Child(spec=spec, policy=spec.policy())
    child.spawned(sleeper, now=0.0)
    other.spawned(sleeper + 1, now=0.0)
    apply_samples([child, other], got)
    assert child.rss_bytes == got[sleeper].rss_bytes and child.uss_bytes == got[sleeper].uss_bytes
    assert other.rss_bytes is None and other.uss_bytes is None
    apply_samples([child], {sleeper: Sample(1.0, 7, None)})  # no USS read: the last one stands
    assert child.rss_bytes == 7 and child.uss_bytes == got[sleeper].uss_bytes


def test_a_pass_without_uss_reads_none_and_the_next_reads_the_never_read(sleeper: int) -> None:
    """While agents are being started the supervisor asks for passes without
    USS (smaps_rollup, the expensive read); CPU and RSS are still read, and
    the never-read children come first again once USS is asked for."""
    me = os.getpid()
    # a budget no loaded machine exceeds: what is checked here is the order
    sampler = Sampler(uss_per_pass=2, uss_budget_s=60.0)
    quiet = sampler.sample([me, sleeper], with_uss=False)
    assert set(quiet) == {me, sleeper} and all(s.rss_bytes > 0 for s in quiet.values())
    assert _with_uss(quiet) == set()
    assert _with_uss(sampler.sample([me, sleeper])) == {me, sleeper}


def test_the_thread_passes_on_the_uss_choice_of_each_submit(sleeper: int) -> None:
    thread = SamplerThread()
    try:
        thread.submit([sleeper], uss=False)
        got = wait_for(thread.take, 20, "a finished pass")
        assert set(got) == {sleeper} and got[sleeper].uss_bytes is None
        thread.submit([sleeper])
        again = wait_for(thread.take, 20, "a finished pass")
        assert again[sleeper].uss_bytes is not None
    finally:
        thread.close()


def test_a_limited_pass_samples_that_many_pids_in_turn(sleeper: int) -> None:
    """While nobody looks, a pass reads `limit` children, the next ones each
    pass (supervisor/runtime/publisher.py SAMPLE_TRICKLE): every child comes up in turn."""
    me = os.getpid()
    pids = [me, sleeper, me, sleeper, me]  # the order is what a pass walks
    sampler = Sampler()
    assert set(sampler.sample(pids[:2], limit=1)) == {me}
    assert set(sampler.sample(pids[:2], limit=1)) == {sleeper}
    assert set(sampler.sample(pids[:2], limit=1)) == {me}  # round again
    assert set(sampler.sample(pids[:2], limit=5)) == {me, sleeper}  # more than there are: all
