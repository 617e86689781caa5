"""CURVE security for actors on other hosts (`tcp://` endpoints) and its keys.

See docs/protocol.md ("Transport", "Authentication").
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from broker.errors import ConfigError

SERVER = "server"
LOCAL_CLIENT = "local"


@dataclass(frozen=True)
class CurveServer:
    public: bytes
    secret: bytes
    authorized_dir: Path


@dataclass(frozen=True)
class CurveClient:
    server_public: bytes
    public: bytes
    secret: bytes


def keys_dir(state_root: Path) -> Path:
    return state_root / "keys"


def generate(keys: Path, clients: tuple[str, ...] = (LOCAL_CLIENT,)) -> None:
    """Create the server keypair (if absent) and a keypair per client name,
    each authorized. Secret files are 0600 in a 0700 directory."""
    old = os.umask(0o077)
    try:
        for sub in (keys, keys / "clients", keys / "authorized"):
            sub.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (keys / f"{SERVER}.key_secret").exists():
            zmq.auth.create_certificates(keys, SERVER)
        for name in clients:
            if not (keys / "clients" / f"{name}.key_secret").exists():
                zmq.auth.create_certificates(keys / "clients", name)
            shutil.copyfile(keys / "clients" / f"{name}.key", keys / "authorized" / f"{name}.key")
    finally:
        os.umask(old)


def _load(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE certificate {path}: {exc}") from exc
    if want_secret and secret is None:
        raise ConfigError(f"{path} holds no secret key")
    return public, secret


def load_server(keys: Path) -> CurveServer:
    public, secret = _load(keys / f"{SERVER}.key_secret", want_secret=True)
    assert secret is not None
    return CurveServer(public=public, secret=secret, authorized_dir=keys / "authorized")


def load_client(keys: Path, name: str = LOCAL_CLIENT) -> CurveClient:
    server_public, _ = _load(keys / f"{SERVER}.key", want_secret=False)
    public, secret = _load(keys / "clients" / f"{name}.key_secret", want_secret=True)
    assert secret is not None
    return CurveClient(server_public=server_public, public=public, secret=secret)


def apply_server(sock: zmq.Socket[bytes], server: CurveServer) -> None:
    """Call before bind()."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"corral")  # broker/auth.py's ZAP handler serves it
    sock.setsockopt(zmq.CURVE_PUBLICKEY, server.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.secret)


def apply_client(sock: zmq.Socket[bytes], client: CurveClient) -> None:
    """Call before connect()."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, client.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --curve and --tcp options of a process that binds (writer, broker)."""
    parser.add_argument(
        "--curve",
        action="store_true",
        help="require CURVE on every connection (keys in <state-dir>/keys)",
    )
    parser.add_argument(
        "--tcp",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="also bind this tcp:// endpoint (needs --curve; port * picks one)",
    )


def check_endpoints(endpoints: tuple[str, ...], curve: bool) -> None:
    """Refuse plain tcp:// (and anything but tcp:// as an extra endpoint)."""
    for endpoint in endpoints:
        if not endpoint.startswith("tcp://"):
            raise ConfigError(f"extra endpoint {endpoint!r}: only tcp:// endpoints may be added")
        if not curve:
            raise ConfigError(f"{endpoint}: tcp:// is served only with CURVE on (--curve)")
