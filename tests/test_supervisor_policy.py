"""Restart decisions (supervisor/runtime/policy.py) and the configuration model,
tested apart from any process."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from broker.errors import ConfigError
from supervisor import config as config_mod
from supervisor.runtime.policy import (
    Exit,
    GiveUp,
    Policy,
    Restart,
    Stay,
    backoff_delay_s,
    counted_exits,
    decide,
    trim,
)

exits = st.builds(
    Exit,
    at_s=st.floats(min_value=0, max_value=1000),
    code=st.one_of(st.none(), st.integers(0, 255)),
    signal=st.one_of(st.none(), st.integers(1, 64)),
    requested=st.booleans(),
)
policies = st.builds(
    Policy,
    restart=st.sampled_from(["permanent", "transient", "temporary"]),
    max_restarts=st.integers(0, 20),
    period_s=st.floats(min_value=0.1, max_value=500),
    base_s=st.floats(min_value=0, max_value=10),
    cap_s=st.floats(min_value=0, max_value=60),
    jitter=st.floats(min_value=0, max_value=1),
    fatal_exit_codes=st.frozensets(st.integers(0, 255), max_size=3),
)


@given(policies, st.lists(exits, min_size=1, max_size=30), st.floats(0, 0.999999))
def test_decision_is_always_one_of_the_documented_outcomes(
    policy: Policy, history: list[Exit], rand: float
) -> None:
    history.sort(key=lambda e: e.at_s)
    now = history[-1].at_s
    decision = decide(policy, history, now, rand)
    last = history[-1]
    if last.requested:
        assert decision == Restart(0.0)
    elif last.signal is None and last.code in policy.fatal_exit_codes:
        assert isinstance(decision, GiveUp)
    elif policy.restart == "temporary" or (policy.restart == "transient" and last.normal):
        assert isinstance(decision, Stay)
    elif counted_exits(policy, history, now) > policy.max_restarts:
        assert isinstance(decision, GiveUp)
    else:
        assert isinstance(decision, Restart)
        assert 0.0 <= decision.delay_s <= policy.cap_s


@given(policies, st.integers(1, 100), st.floats(0, 0.999999))
def test_backoff_is_capped_and_zero_for_a_first_exit(
    policy: Policy, counted: int, rand: float
) -> None:
    delay = backoff_delay_s(policy, counted, rand)
    assert 0.0 <= delay <= policy.cap_s
    if counted == 1:
        assert delay == 0.0


def test_backoff_doubles_without_jitter_until_the_cap() -> None:
    policy = Policy(base_s=0.1, cap_s=1.0, jitter=0.0)
    delays = [backoff_delay_s(policy, n, 0.5) for n in range(1, 8)]
    assert delays == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_intensity_counts_only_exits_inside_the_period() -> None:
    policy = Policy(max_restarts=2, period_s=10.0)
    old = [Exit(at_s=t, code=1) for t in (0.0, 1.0, 2.0)]
    assert isinstance(decide(policy, old, 2.0, 0.5), GiveUp)
    assert isinstance(decide(policy, [*old, Exit(at_s=20.0, code=1)], 20.0, 0.5), Restart)


def test_requested_restarts_do_not_count_against_intensity() -> None:
    policy = Policy(max_restarts=1, period_s=10.0)
    history = [Exit(at_s=t, code=0, requested=True) for t in range(5)]
    assert decide(policy, history, 5.0, 0.5) == Restart(0.0)
    assert isinstance(decide(policy, [*history, Exit(at_s=5.0, code=1)], 5.0, 0.5), Restart)


def test_fatal_exit_code_gives_up_at_once_but_a_signal_does_not() -> None:
    policy = Policy(fatal_exit_codes=frozenset({65}))
    assert isinstance(decide(policy, [Exit(at_s=0, code=65)], 0, 0.5), GiveUp)
    assert isinstance(decide(policy, [Exit(at_s=0, signal=9)], 0, 0.5), Restart)


def test_transient_restarts_only_after_an_abnormal_exit() -> None:
    policy = Policy(restart="transient")
    assert isinstance(decide(policy, [Exit(at_s=0, code=0)], 0, 0.5), Stay)
    assert isinstance(decide(policy, [Exit(at_s=0, code=2)], 0, 0.5), Restart)
    assert isinstance(decide(policy, [Exit(at_s=0, signal=15)], 0, 0.5), Restart)


def test_decide_refuses_an_empty_history() -> None:
    with pytest.raises(ValueError, match="at least one exit"):
        decide(Policy(), [], 0.0, 0.5)


@given(policies, st.lists(exits, min_size=1, max_size=40))
@example(  # found by CI: operator restarts after the crashes pushed the crashes out
    Policy(restart="permanent", max_restarts=3, period_s=1.0, base_s=0.0, cap_s=0.0, jitter=0.0),
    [Exit(at_s=0.0, code=None, signal=None, requested=False)] * 4
    + [Exit(at_s=0.0, code=None, signal=None, requested=True)] * 5,
)
def test_trim_keeps_what_the_decision_needs(policy: Policy, history: list[Exit]) -> None:
    history.sort(key=lambda e: e.at_s)
    now = history[-1].at_s
    trimmed = trim(policy, history, now)
    assert len(trimmed) <= max(8, policy.max_restarts + 2)
    assert (counted_exits(policy, trimmed, now) > policy.max_restarts) == (
        counted_exits(policy, history, now) > policy.max_restarts
    )


# --- configuration --------------------------------------------------------------
def test_default_config_loads_with_writer_then_broker() -> None:
    config = config_mod.load(None)
    assert [s.kind for s in config.child_specs()] == ["writer", "broker", "procs", "subagents"]


def test_agents_group_expands_in_start_order() -> None:
    data = yaml.safe_load(config_mod.DEFAULT_CONFIG_PATH.read_text())
    data["agents"]["count"] = 3
    data["children"][2]["enabled"] = True  # procs
    data["children"][3]["enabled"] = False  # subagents
    specs = config_mod.parse(data, "x.yaml").child_specs()
    assert [s.name for s in specs] == ["writer", "broker", "procs", "agent-1", "agent-2",
                                       "agent-3"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("children: [{name: writer, kind: writer, restart: sometimes}, {name: b, kind: broker}]",
         "children.0.restart: expected 'permanent', 'transient' or 'temporary'"),
        ("heartbeat: {interval_ms: fast}", "heartbeat.interval_ms: expected a valid integer"),
        ("colour: blue", "colour: unknown key"),
        ("children: []", "exactly one enabled writer"),
        ("agents: {backoff: {cap_s: -1}}", "agents.backoff.cap_s: expected greater than"),
    ],
)
def test_invalid_config_names_the_file_and_the_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config_mod.load(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)
