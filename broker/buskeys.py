"""Per-host bus keys (docs/fleet.md, "Messages between hosts"): who signed a
frame between hosts.

The fleet's bus key (broker/bridge.py `bus_key`) is derived from the fleet
key every host holds, so it proves only that a frame comes from *some* host
of the fleet. Each host also has a key of its own that no other host can
derive: an Ed25519 private key the host's broker generates on its first fleet
start (`.corral/fleet/bus-host.key`, 0600) and never sends anywhere. Its
public half is registered in the KV bucket `corral_bus_keys` under the host's
name with a create (only when the name has none). A receiving bridge pins the
first key it reads for each host and never replaces it (a later different
value is logged `bus_key_changed` and ignored), and refuses a frame whose
claimed sending host has no key known to it or whose signature that key does
not verify.

What it defends against: a host (or anyone holding the fleet key and NATS
access) publishing frames that claim to come from another host whose key the
receiver already pinned. What it does not: a holder of the fleet key who
registers a host's name before the host itself does, or who deletes the
entry before a receiver that never saw it reads it (NATS permissions per
host close that: each host allowed to write only `$KV.corral_bus_keys.<own
name>`); and the fleet key itself still authenticates operator requests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from broker.durable import write_atomic

if TYPE_CHECKING:  # the fleet extra: imported where used, so a plain broker needs none
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

log = structlog.get_logger("broker.bridge")

BUCKET = "corral_bus_keys"
KEY_FILE = "bus-host.key"
PUBLIC_HEX = 64  # an Ed25519 public key, hex
SIG_HEX = 128  # an Ed25519 signature, hex


def key_path(state_root: Path) -> Path:
    return state_root / "fleet" / KEY_FILE


def load_or_create(path: Path) -> Ed25519PrivateKey:
    """This host's private key: read, or made and written (0600) on first use."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PrivateKey,
    )

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        key = Ed25519PrivateKey.generate()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, key.private_bytes(serialization.Encoding.Raw,
                                             serialization.PrivateFormat.Raw,
                                             serialization.NoEncryption()))
        os.chmod(path, 0o600)
        return key
    if len(raw) != 32:
        raise ValueError(f"{path}: not an Ed25519 private key")
    return Ed25519PrivateKey.from_private_bytes(raw)


def public_hex(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw).hex()


def signature(key: Ed25519PrivateKey, data: bytes) -> str:
    return key.sign(data).hex()


def verified(public: str, sig: str, data: bytes) -> bool:
    """Whether `sig` (hex) is `public`'s (hex) signature of `data`; False for
    anything malformed."""
    from cryptography.exceptions import InvalidSignature  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PublicKey,
    )

    if len(public) != PUBLIC_HEX or len(sig) != SIG_HEX:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(sig), data)
    except (ValueError, InvalidSignature):
        return False
    return True


async def bucket(js: Any, replicas: int = 1) -> Any:
    from nats.js.api import KeyValueConfig, StorageType  # noqa: PLC0415
    from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(KeyValueConfig(
                bucket=BUCKET, history=1, replicas=replicas, storage=StorageType.FILE))
        except Exception:  # noqa: BLE001 - made by another host meanwhile
            return await js.key_value(BUCKET)


async def register(js: Any, host: str, public: str, replicas: int) -> bool:
    """Put this host's public key under its name unless the name has one; True
    when the registered key is ours (False: another key holds the name)."""
    kv = await bucket(js, replicas)
    try:
        await kv.create(host, public.encode())
    except Exception:  # noqa: BLE001 - the name has a key: ours, or another's
        entry = await kv.get(host)
        return bytes(entry.value or b"").decode(errors="replace") == public
    return True


class Pins:
    """The public key of each host as first read (never replaced)."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def update(self, entries: dict[str, bytes]) -> None:
        for host, value in entries.items():
            public = value.decode(errors="replace")
            if len(public) != PUBLIC_HEX:
                continue
            known = self.keys.get(host)
            if known is None:
                self.keys[host] = public
            elif known != public:
                log.error("bus_key_changed", host=host[:64], pinned=known[:16],
                          offered=public[:16])

    def get(self, host: str) -> str | None:
        return self.keys.get(host)
