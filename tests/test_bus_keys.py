"""Per-host bus keys without processes (supervisor/fleet/buskeys.py, supervisor/fleet/bridge.py
`verify`): a frame is accepted only when the host it claims to come from
signed it with its own key, as pinned by the receiver; a host holding the
fleet key (so a valid fleet MAC) cannot speak for another host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from supervisor.fleet import buskeys
from supervisor.fleet.bridge import (
    H_MAC,
    H_NONCE,
    H_SIG,
    H_TS,
    BusRefusedError,
    _mac,
    bus_key,
    sign,
    verify,
)

FLEET = bus_key(b"the-fleet-key")


def test_only_the_claimed_hosts_own_key_is_accepted(tmp_path: Path) -> None:
    key_a = buskeys.load_or_create(tmp_path / "a" / buskeys.KEY_FILE)
    key_c = buskeys.load_or_create(tmp_path / "c" / buskeys.KEY_FILE)
    assert (tmp_path / "a" / buskeys.KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert buskeys.public_hex(buskeys.load_or_create(tmp_path / "a" / buskeys.KEY_FILE)) == \
        buskeys.public_hex(key_a)  # read back, not made again
    pins = buskeys.Pins()
    pins.update({"ha": buskeys.public_hex(key_a).encode(),
                 "hc": buskeys.public_hex(key_c).encode(), "hx": b"not a key"})
    body = b"frame"
    now = time.time()

    def check(headers: dict[str, str]) -> tuple[str, str]:
        return verify(FLEET, "hb", headers, body, {}, 1 << 20, now, pins)

    assert check(sign(FLEET, "ha:probe", "hb:target", body, now, key_a)) == (
        "ha:probe", "target")
    assert check(sign(FLEET, "hc:probe", "hb:target", body, now, key_c))[0] == "hc:probe"
    forged = [
        sign(FLEET, "ha:probe", "hb:target", body, now, key_c),  # host C speaking as A
        sign(FLEET, "ha:probe", "hb:target", body, now),  # the fleet MAC alone
        sign(FLEET, "hx:probe", "hb:target", body, now, key_c),  # a host with no key
        {**sign(FLEET, "ha:probe", "hb:target", body, now, key_a), H_SIG: "00" * 64},
    ]
    # A's signature moved onto another body, the fleet MAC made again (as any
    # holder of the fleet key can)
    moved = sign(FLEET, "ha:probe", "hb:target", body, now, key_a)
    moved[H_MAC] = _mac(FLEET, "ha:probe", "hb:target", moved[H_TS], moved[H_NONCE], b"other")
    for headers in forged:
        with pytest.raises(BusRefusedError):
            check(headers)
    with pytest.raises(BusRefusedError, match="own key"):
        verify(FLEET, "hb", moved, b"other", {}, 1 << 20, now, pins)
    # a key registered later under A's name is never taken
    pins.update({"ha": buskeys.public_hex(key_c).encode()})
    assert pins.get("ha") == buskeys.public_hex(key_a)


def test_a_damaged_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / buskeys.KEY_FILE
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="not an Ed25519"):
        buskeys.load_or_create(path)
    assert not buskeys.verified("zz" * 32, "00" * 64, b"x")
