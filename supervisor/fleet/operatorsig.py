"""The fleet operator's Ed25519 signature over control requests.

The private key is never on a host. See docs/fleet.md ("One view") and
docs/decisions.md ("Fleet control: the operator signs with its own key; hosts
share a bus secret").
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.durable import write_atomic

if TYPE_CHECKING:  # the fleet extra: imported where used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

DOMAIN = b"corral-operator-v1\n"
MAX_SKEW_S = 30.0
MAX_REQUEST_BYTES = 128 * 1024
NONCES_MAX = 100_000
KEY_HEX = 64  # an Ed25519 key (private seed or public), hex
SIG_HEX = 128
PRIVATE_FILE, PUBLIC_FILE = "operator.key", "operator.pub"


class SignatureRefusedError(Exception):
    """A request refused before its content is looked at (the reason is the message)."""


def _hex_key(path: Path, what: str) -> bytes:
    text = path.read_bytes().strip()
    try:
        raw = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raw = b""
    if len(raw) != KEY_HEX // 2:
        raise ValueError(f"{path}: not an Ed25519 {what} key (64 hex characters)")
    return raw


def load_private(path: Path) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PrivateKey,
    )

    return Ed25519PrivateKey.from_private_bytes(_hex_key(path, "private"))


def load_public(path: Path) -> str:
    """The public key's hex text (checked)."""
    return _hex_key(path, "public").hex()


def public_hex(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw).hex()


def make_keys(directory: Path) -> tuple[Path, Path]:
    """(private, public) paths of the operator's key pair in `directory`,
    made (private 0600) unless the private key is already there."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PrivateKey,
    )

    private, public = directory / PRIVATE_FILE, directory / PUBLIC_FILE
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if private.exists():
        key = load_private(private)
    else:
        key = Ed25519PrivateKey.generate()
        seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
        write_atomic(private, seed.hex().encode() + b"\n")
        os.chmod(private, 0o600)
    write_atomic(public, public_hex(key).encode() + b"\n")
    return private, public


def _canonical(body: dict[str, Any]) -> bytes:
    return DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(key: Ed25519PrivateKey, body: dict[str, Any], now: float | None = None) -> bytes:
    """The signed request: `body` with `ts`, `nonce` and `sig`."""
    full = {**body, "ts": round(time.time() if now is None else now, 3),
            "nonce": secrets.token_hex(16)}
    return json.dumps({**full, "sig": key.sign(_canonical(full)).hex()}).encode()


def verified(public: str, sig: str, data: bytes) -> bool:
    """Whether `sig` (hex) is `public`'s (hex) Ed25519 signature of `data`;
    False for anything malformed (also the bus keys': supervisor/fleet/buskeys.py)."""
    from cryptography.exceptions import InvalidSignature  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PublicKey,
    )

    if len(public) != KEY_HEX or len(sig) != SIG_HEX:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(sig), data)
    except (ValueError, InvalidSignature):
        return False
    return True


class Nonces(dict[str, float]):
    """The nonces a verifier has taken (nonce -> when) and when it started.
    They live in memory only, so a request taken before a restart could be
    replayed within the window after it; `verify` therefore refuses a request
    signed before `since` (the operator signs again: requests are fresh)."""

    def __init__(self, since: float | None = None) -> None:
        super().__init__()
        self.since = time.time() if since is None else since


def verify(data: bytes, public: str | None, seen: dict[str, float],
           now: float | None = None) -> dict[str, Any]:
    """The request (a dict, without `sig`), or SignatureRefusedError: not the
    operator's signature, a timestamp out of the window, a replayed nonce, or
    (when `seen` is a `Nonces`) signed before the verifier started. `seen`
    remembers nonces (bounded)."""
    if not public:
        raise SignatureRefusedError(
            "this host has no fleet.operator_public_key: fleet control is off")
    if len(data) > MAX_REQUEST_BYTES:
        raise SignatureRefusedError("request too large")
    try:
        request = json.loads(data)
    except ValueError:
        raise SignatureRefusedError("not JSON") from None
    if not isinstance(request, dict):
        raise SignatureRefusedError("malformed request")
    sig = request.pop("sig", None)
    if not isinstance(sig, str) or not verified(public, sig, _canonical(request)):
        raise SignatureRefusedError("bad signature: not the fleet operator's key")
    at = time.time() if now is None else now
    ts, nonce = request.get("ts"), request.get("nonce")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or abs(at - ts) > MAX_SKEW_S:
        raise SignatureRefusedError("stale or future timestamp")
    if isinstance(seen, Nonces) and ts < seen.since:
        raise SignatureRefusedError("signed before this verifier started (a replay across "
                                    "a restart is not taken): sign it again")
    for old, when in list(seen.items()):
        if at - when > 2 * MAX_SKEW_S:
            del seen[old]
    if not isinstance(nonce, str) or not 0 < len(nonce) <= 64 or nonce in seen:
        raise SignatureRefusedError("replayed request")
    if len(seen) >= NONCES_MAX:
        raise SignatureRefusedError("too many requests in the replay window")
    seen[nonce] = at
    return request
