"""Each kind's command line carries the logging settings (supervisor/runtime/commands.py),
and so do the zygote's arguments, from which every forked agent configures its
log. Real rotation per kind: tests/test_supervisor_control.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.statedir import StateDir
from supervisor.config import ChildSpec, Config, LoggingConfig
from supervisor.fleetconfig import OPERATOR_KEY_ENV
from supervisor.runtime import commands, reload

CORE = [ChildSpec(name="writer", kind="writer"), ChildSpec(name="broker", kind="broker")]


def _config(**logging: object) -> Config:
    return Config(children=CORE, logging=LoggingConfig.model_validate(logging))


def _option(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, argv
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("kind", ["writer", "broker", "procs", "subagents", "agent"])
def test_every_kind_gets_level_size_and_backups(kind: str, tmp_path: Path) -> None:
    config = _config(level="debug", max_bytes=20000, backups=3)
    argv = commands.argv_for(ChildSpec(name=f"{kind}-x", kind=kind), config,  # type: ignore[arg-type]
                             StateDir(tmp_path))
    assert (_option(argv, "--log-level"), _option(argv, "--log-max-bytes"),
            _option(argv, "--log-backups")) == ("debug", "20000", "3")


def test_forked_agents_get_them_through_the_zygote(tmp_path: Path) -> None:
    argv = commands.zygote_args(_config(level="warning", max_bytes=8192, backups=0),
                                StateDir(tmp_path))
    assert (_option(argv, "--log-level"), _option(argv, "--log-max-bytes"),
            _option(argv, "--log-backups")) == ("warning", "8192", "0")


def test_reload_plan_restarts_only_the_children_a_change_concerns(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    procs = ChildSpec(name="procs", kind="procs")
    old = Config(children=[*CORE, procs], agents={"count": 2})  # type: ignore[arg-type]
    running = {s.name: reload.Running(s) for s in old.child_specs()}
    running["extra"] = reload.Running(ChildSpec(name="extra", kind="agent"),
                                      spawned_by_operator=True)
    same = reload.plan(old, old, running, state)
    assert (same.start, same.stop, same.restart, same.unchanged) == ([], [], [], 6)

    new = old.model_copy(update={
        "children": [*CORE, procs.model_copy(update={"shutdown_timeout_s": 9.0})],
        "agents": old.agents.model_copy(update={"count": 1})})
    plan = reload.plan(old, new, running, state)
    assert [s.name for s in plan.restart] == ["procs"]
    assert plan.stop == ["agent-2"] and plan.start == [] and not plan.zygote_changed

    louder = old.model_copy(update={"logging": LoggingConfig(level="debug")})
    plan = reload.plan(old, louder, running, state)
    assert {s.name for s in plan.restart} == {"writer", "broker", "procs", "agent-1", "agent-2"}
    assert plan.zygote_changed


def test_procs_hides_the_fleet_credential_files_from_every_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPERATOR_KEY_ENV, raising=False)
    fleet = {"host": "h1", "urls": ["nats://127.0.0.1:4222"], "creds": "keys/nats.creds",
             "nkey_seed": "/etc/corral/seed.nk", "bus_secret": "/etc/corral/bus.secret",
             "operator_public_key": "/etc/corral/operator.pub",
             "tls": {"ca": "/etc/corral/ca.pem", "key": "/etc/corral/tls.key"}}
    config = Config(children=CORE, fleet=fleet, sandbox={"hide": ["/run", "/srv/private"]})
    argv = commands.argv_for(ChildSpec(name="procs", kind="procs"), config, StateDir(tmp_path))
    hidden = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--sandbox-hide"]
    assert hidden == ["/run", "/srv/private", str(Path("keys/nats.creds").absolute()),
                      "/etc/corral/seed.nk", "/etc/corral/tls.key", "/etc/corral/bus.secret"]
    # the CA and the operator's public key are public; without fleet mode no credential
    # is in use, and none is added
    assert "/etc/corral/ca.pem" not in argv and "/etc/corral/operator.pub" not in argv
    alone = commands.argv_for(ChildSpec(name="procs", kind="procs"), _config(), StateDir(tmp_path))
    assert [alone[i + 1] for i, arg in enumerate(alone) if arg == "--sandbox-hide"] == ["/run"]
    # a machine that is the operator's too: the private key its environment names
    monkeypatch.setenv(OPERATOR_KEY_ENV, "/home/op/operator.key")
    both = commands.argv_for(ChildSpec(name="procs", kind="procs"), _config(), StateDir(tmp_path))
    assert [both[i + 1] for i, arg in enumerate(both) if arg == "--sandbox-hide"] == [
        "/run", "/home/op/operator.key"]


@pytest.mark.parametrize("pool", [None, 0, 3])
def test_the_zygote_pool_reaches_the_zygote_and_stays_out_of_each_agent(
        pool: int | None, tmp_path: Path) -> None:
    config = Config(children=CORE, agents={"count": 2, "zygote_pool": pool})
    argv = commands.zygote_args(config, StateDir(tmp_path))
    assert _option(argv, "--pool") == str(commands.ZYGOTE_POOL if pool is None else pool)
    agents = [s for s in config.child_specs() if s.kind == "agent"]
    assert [s.name for s in agents] == ["agent-1", "agent-2"]
    assert ChildSpec(name="agent-3", kind="agent", **config.agents.child_template()).kind \
        == "agent"  # what `supervisor spawn` builds
