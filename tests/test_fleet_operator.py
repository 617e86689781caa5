"""The fleet operator's signature (supervisor/fleet/operatorsig.py, supervisor/fleet/ctl.py
`verify`, supervisor/fleet/buskeys.py `check_forget`): only the operator's private key
makes a request a host accepts; nothing a host holds does (the old shared
key, the hosts' bus secret, its own bus key); tampered, stale and replayed
requests are refused, a replay across a verifier's restart too; a
configuration still naming the shared operator key
is refused with the names of the new keys."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from broker.errors import ConfigError
from supervisor.config import parse
from supervisor.fleet import buskeys, ctl, operatorsig
from supervisor.fleetconfig import FleetConfig

HOST = "hb"


@pytest.fixture
def operator(tmp_path: Path) -> tuple[Ed25519PrivateKey, str]:
    private, public = operatorsig.make_keys(tmp_path / "op")
    return operatorsig.load_private(private), operatorsig.load_public(public)


def _resign(key: Ed25519PrivateKey, request: dict[str, Any]) -> bytes:
    """`request` (with its ts and nonce) signed as the operator would sign it."""
    body = {k: v for k, v in request.items() if k != "sig"}
    return json.dumps({**body, "sig": key.sign(operatorsig._canonical(body)).hex()}).encode()


def test_the_operators_request_is_accepted_once(operator: tuple[Ed25519PrivateKey, str]) -> None:
    key, public = operator
    seen: dict[str, float] = {}
    data = ctl.sign(key, "stop", HOST, "agent-1")
    request = ctl.verify(data, HOST, public, seen)
    assert (request["verb"], request["host"], request["agent"]) == ("stop", HOST, "agent-1")
    with pytest.raises(ctl.FleetControlError, match="replayed"):
        ctl.verify(data, HOST, public, seen)
    spawn = ctl.verify(ctl.sign(key, "spawn", HOST, "x", task="steps: []", model=None),
                            HOST, public, seen)
    assert spawn["task"] == "steps: []"


def test_a_request_taken_before_a_restart_is_not_taken_again_after_it(
        operator: tuple[Ed25519PrivateKey, str]) -> None:
    """Nonces live in memory: a verifier started after a request was signed
    (a restarted host supervisor or broker) refuses it, within the window
    too, and takes one the operator signs afresh."""
    key, public = operator
    data = ctl.sign(key, "stop", HOST, "agent-1")
    signed_at = json.loads(data)["ts"]
    before_restart = operatorsig.Nonces(since=signed_at - 1)
    ctl.verify(data, HOST, public, before_restart)  # taken once
    restarted = operatorsig.Nonces(since=signed_at + 0.5)  # its memory of nonces gone
    with pytest.raises(ctl.FleetControlError, match="signed before this verifier started"):
        ctl.verify(data, HOST, public, restarted)
    fresh = operatorsig.sign(key, {"verb": "stop", "host": HOST, "agent": "agent-1",
                                   "signal": 15}, now=signed_at + 1)  # signed after it
    assert ctl.verify(fresh, HOST, public, restarted)["agent"] == "agent-1"


@pytest.mark.parametrize(("field", "value"), [
    ("verb", "kill"), ("host", "hc"), ("agent", "agent-2"), ("signal", 9),
    ("task", "steps: [{op: bash}]"), ("ts", 0), ("nonce", "0" * 32)])
def test_a_tampered_field_breaks_the_signature(
        operator: tuple[Ed25519PrivateKey, str], field: str, value: object) -> None:
    key, public = operator
    request = json.loads(ctl.sign(key, "stop", HOST, "agent-1", task="steps: []"))
    request[field] = value
    with pytest.raises(ctl.FleetControlError, match="bad signature"):
        ctl.verify(json.dumps(request).encode(), HOST, public, {})


def test_nothing_a_host_holds_signs_a_request_another_host_accepts(
        tmp_path: Path, operator: tuple[Ed25519PrivateKey, str]) -> None:
    """A host holds its configuration (the operator's *public* key, the bus
    secret), its state directory (its own bus key) and, before this change,
    the shared operator key: none of them makes an accepted request."""
    _, public = operator
    shared = b"the-old-shared-operator-key"
    bus_secret = buskeys.make_bus_secret(tmp_path / "bus.secret").read_bytes().strip()
    host_bus_key = buskeys.load_or_create(tmp_path / "ha" / buskeys.KEY_FILE)
    body = {"verb": "stop", "host": HOST, "agent": "agent-1", "signal": 15,
            "ts": round(time.time(), 3), "nonce": os.urandom(16).hex()}

    def old_format(secret: bytes) -> bytes:  # the request the shared key used to sign
        text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return json.dumps({**body, "mac": hmac.new(secret, text, hashlib.sha256).hexdigest()
                           }).encode()

    forged = [
        old_format(shared), old_format(bus_secret),
        ctl.sign(host_bus_key, "stop", HOST, "agent-1"),  # the host's own Ed25519 key
        # the public key is not a key that signs: its bytes as a seed make another key
        ctl.sign(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(public)),
                      "stop", HOST, "agent-1"),
        json.dumps({**body, "sig": "00" * 64}).encode(),
        json.dumps({**body, "sig": 5}).encode(),
        json.dumps(body).encode(),
    ]
    for data in forged:
        with pytest.raises(ctl.FleetControlError, match="bad signature"):
            ctl.verify(data, HOST, public, {})


def test_stale_misaddressed_and_malformed_requests_are_refused(
        operator: tuple[Ed25519PrivateKey, str]) -> None:
    key, public = operator
    stale = operatorsig.sign(key, {"verb": "stop", "host": HOST, "agent": "a", "signal": 15},
                             now=time.time() - 31)
    # 90 s ahead, not 31: 31 s left one second for the verify below, a bet a loaded
    # machine can lose (the skew allowed is 30 s either way)
    future = operatorsig.sign(key, {"verb": "stop", "host": HOST, "agent": "a", "signal": 15},
                              now=time.time() + 90)
    for data in (stale, future):
        with pytest.raises(ctl.FleetControlError, match="timestamp"):
            ctl.verify(data, HOST, public, {})
    cases = [
        (ctl.sign(key, "stop", "hc", "agent-1"), "addressed to"),
        (ctl.sign(key, "reboot", HOST, "agent-1"), "unknown verb"),
        (ctl.sign(key, "stop", HOST, "../etc"), "not an actor name"),
        (ctl.sign(key, "kill", HOST, "agent-1", sig=99), "bad signal"),
        (ctl.sign(key, "spawn", HOST, "agent-1"), "task"),
        (operatorsig.sign(key, {"verb": "stop", "host": HOST, "agent": "a", "signal": 15,
                                "extra": "x"}), "malformed"),
        (buskeys.forget_request(key, HOST), "malformed"),  # not a control request
        (b"not json", "not JSON"), (b"[]", "malformed"),
        (b" " * (operatorsig.MAX_REQUEST_BYTES + 1), "too large"),
    ]
    for data, reason in cases:
        with pytest.raises(ctl.FleetControlError, match=reason):
            ctl.verify(data, HOST, public, {})
    with pytest.raises(ctl.FleetControlError, match="control is off"):
        ctl.verify(ctl.sign(key, "stop", HOST, "a"), HOST, None, {})


def test_a_resigned_request_is_the_operators_only(
        operator: tuple[Ed25519PrivateKey, str]) -> None:
    """The signature covers the canonical body: re-signing a changed body
    with any other key is refused; with the operator's, it is a new request."""
    key, public = operator
    request = json.loads(ctl.sign(key, "stop", HOST, "agent-1"))
    request["verb"] = "kill"
    with pytest.raises(ctl.FleetControlError, match="bad signature"):
        ctl.verify(_resign(Ed25519PrivateKey.generate(), request), HOST, public, {})
    assert ctl.verify(_resign(key, request), HOST, public, {})["verb"] == "kill"


def test_forget_bus_key_is_the_operators_and_once(
        tmp_path: Path, operator: tuple[Ed25519PrivateKey, str]) -> None:
    key, public = operator
    seen: dict[str, float] = {}
    data = buskeys.forget_request(key, "ha")
    assert buskeys.check_forget(data, public, seen) == "ha"
    with pytest.raises(buskeys.ForgetRefusedError, match="replayed"):
        buskeys.check_forget(data, public, seen)
    host_key = buskeys.load_or_create(tmp_path / "ha" / buskeys.KEY_FILE)
    refused = [
        (buskeys.forget_request(host_key, "ha"), "bad signature"),  # a host's own key
        (buskeys.forget_request(key, "ha", now=time.time() - 60), "timestamp"),
        (ctl.sign(key, "kill", "ha", "agent-1"), "not a forget-bus-key"),
        (operatorsig.sign(key, {"verb": "forget-bus-key", "host": "no/such"}), "host name"),
        (buskeys.forget_request(key, "ha"), "control is off"),
    ]
    for index, (request, reason) in enumerate(refused):
        with pytest.raises(buskeys.ForgetRefusedError, match=reason):
            buskeys.check_forget(request, None if index == 4 else public, {})


def test_pins_drop_on_forget_and_ignore_a_read_begun_before() -> None:
    pins = buskeys.Pins()
    old, new = "aa" * 32, "bb" * 32
    pins.update({"ha": old.encode()})
    pins.update({"ha": new.encode()})
    assert pins.get("ha") == old  # never replaced by a later value
    generation = pins.generation
    assert pins.forget("ha") == old
    pins.update({"ha": old.encode()}, generation)  # read before the forget: stale
    assert pins.get("ha") is None
    pins.update({"ha": new.encode()}, pins.generation)
    assert pins.get("ha") == new


def test_operator_keys_are_made_once_private_0600(tmp_path: Path) -> None:
    private, public = operatorsig.make_keys(tmp_path / "fleet")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    again = operatorsig.make_keys(tmp_path / "fleet")
    assert again == (private, public)
    assert operatorsig.load_public(public) == operatorsig.public_hex(
        operatorsig.load_private(private))
    private.write_text("not a key")
    with pytest.raises(ValueError, match="not an Ed25519 private key"):
        operatorsig.load_private(private)
    secret = buskeys.make_bus_secret(tmp_path / "bus.secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text().strip()) == 64


def test_a_config_with_the_shared_operator_key_is_refused() -> None:
    fleet = {"host": "h1", "urls": ["nats://127.0.0.1:4222"], "operator_key": "/etc/k"}
    children = [{"name": "writer", "kind": "writer"}, {"name": "broker", "kind": "broker"}]
    with pytest.raises(ConfigError) as caught:
        parse({"children": children, "fleet": fleet}, "corral.yaml")
    text = str(caught.value)
    assert parse({"children": children, "fleet": {**fleet, "operator_key": None}}, "c").fleet.host
    assert "operator_key" in text and "operator_public_key" in text and "bus_secret" in text
    # run/fleet.json from an earlier version (no key set) still reads
    assert FleetConfig.model_validate_json(json.dumps({**fleet, "operator_key": None})).host == "h1"
    fine = FleetConfig(host="h1", urls=["nats://127.0.0.1:4222"], operator_public_key="/p",
                       bus_secret="/s")
    assert "/s" in fine.broker_args() and "/p" in fine.broker_args()
    assert "/p" not in fine.secret_paths() and "/s" in fine.secret_paths()


def test_the_cli_needs_the_operators_private_key(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.delenv(ctl.OPERATOR_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match="CORRAL_OPERATOR_KEY is not set"):
        ctl.operator_key()
    _, public = operatorsig.make_keys(tmp_path)
    monkeypatch.setenv(ctl.OPERATOR_KEY_ENV, str(public))  # valid hex, but a public key:
    key = ctl.operator_key()  # loads as some other private key, which verifies nothing
    with pytest.raises(ctl.FleetControlError, match="bad signature"):
        ctl.verify(ctl.sign(key, "stop", HOST, "a"), HOST,
                        operatorsig.load_public(public), {})


@pytest.mark.timeout(60)
def test_fleet_commands_on_a_cluster_that_is_away_answer_4(tmp_path: Path) -> None:
    """Before, nats-py retried the first connect forever (max_reconnect_attempts
    0): `status --fleet` and `kill HOST:AGENT` never returned."""
    import subprocess
    import sys

    from supervisor.fleet.cluster import free_ports

    url = f"nats://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    state = tmp_path / ".corral"
    (state / "run").mkdir(parents=True)
    (state / "run" / "fleet.json").write_text(json.dumps({"host": "h1", "urls": [url]}))
    private, _ = operatorsig.make_keys(tmp_path / "op")
    env = {**os.environ, ctl.OPERATOR_KEY_ENV: str(private)}
    for args in (["status", "--fleet"], ["kill", "h1:agent-1"],
                 ["fleet", "forget-bus-key", "h1"]):
        done = subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--state-dir",
                               str(state)], env=env, capture_output=True, text=True,
                              timeout=20, check=False)
        assert done.returncode == ctl.EXIT_NO_ANSWER, (args, done.stderr)
        assert "did not answer" in done.stderr
