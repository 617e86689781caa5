"""Per-host bus keys: which host of the fleet signed a frame (Ed25519, pinned).

See docs/fleet.md ("Messages between hosts") and docs/security.md ("Fleet
control (fleet mode)").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from broker.durable import write_atomic
from supervisor.fleet import operatorsig

if TYPE_CHECKING:  # the fleet extra: imported where used, so a plain broker needs none
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

log = structlog.get_logger("supervisor.fleet.bridge")

BUCKET = "corral_bus_keys"
FORGET_SUBJECT = "corral.buskeys.forget"  # the operator's forget-bus-key, to every bridge
FORGET_VERB = "forget-bus-key"
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


def make_bus_secret(path: Path) -> Path:
    """The hosts' bus secret (`fleet.bus_secret`): made (0600) unless there."""
    import secrets  # noqa: PLC0415

    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, secrets.token_hex(32).encode() + b"\n")
        os.chmod(path, 0o600)
    return path


def public_hex(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw).hex()


def signature(key: Ed25519PrivateKey, data: bytes) -> str:
    return key.sign(data).hex()


verified = operatorsig.verified  # one Ed25519 check for operator requests and bus frames


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
    when the registered key is ours (False: another key holds the name). A
    cluster that does not answer (no responders, no stream response, a
    timeout) raises: the caller tries again, as the bridge does; it was read
    as "the name has a key", whose lookup then failed with KeyNotFoundError."""
    from nats.js.errors import KeyWrongLastSequenceError  # noqa: PLC0415

    kv = await bucket(js, replicas)
    try:
        await kv.create(host, public.encode())
    except KeyWrongLastSequenceError:  # the name has a key: ours, or another's
        entry = await kv.get(host)
        return bytes(entry.value or b"").decode(errors="replace") == public
    return True


async def purge(js: Any, host: str) -> None:
    """Take `host`'s key out of the bucket (the operator's forget-bus-key)."""
    from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

    try:
        kv = await js.key_value(BUCKET)
    except BucketNotFoundError:
        return
    await kv.purge(host)


class ForgetRefusedError(Exception):
    """A forget-bus-key request refused (the reason is the message)."""


def forget_request(operator: Any, host: str, now: float | None = None) -> bytes:
    """`forget-bus-key HOST`, signed with the operator's private key."""
    return operatorsig.sign(operator, {"verb": FORGET_VERB, "host": host}, now)


def check_forget(data: bytes, operator_public: str | None, seen: dict[str, float]) -> str:
    """The host whose pin to drop, or ForgetRefusedError: not signed by the
    operator, stale, replayed, another verb, a malformed host name."""
    from supervisor.fleet.natsclient import HOST_NAME  # noqa: PLC0415

    try:
        request = operatorsig.verify(data, operator_public, seen)
    except operatorsig.SignatureRefusedError as exc:
        raise ForgetRefusedError(str(exc)) from None
    if set(request) != {"verb", "host", "ts", "nonce"} or request["verb"] != FORGET_VERB:
        raise ForgetRefusedError(f"not a {FORGET_VERB} request")
    host = request["host"]
    if not isinstance(host, str) or not HOST_NAME.fullmatch(host):
        raise ForgetRefusedError("not a host name")
    return host


class Pins:
    """The public key of each host as first read (never replaced, except
    after the operator's forget-bus-key)."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.generation = 0  # bumped by forget: a read begun before it is not applied

    def forget(self, host: str) -> str | None:
        """Drop `host`'s pin (the key it had, if any)."""
        self.generation += 1
        return self.keys.pop(host, None)

    def update(self, entries: dict[str, bytes], generation: int | None = None) -> None:
        """Pin the keys read; `generation`, when given, is `self.generation` as
        it was before the read: a forget since then makes the read stale (it
        may hold the forgotten key), and it is skipped until the next round."""
        if generation is not None and generation != self.generation:
            return
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
