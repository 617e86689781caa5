"""How a fleet host's processes reach NATS: names, URLs, credential paths.

Credentials are read by the client and never logged. See docs/fleet.md
("Set-up").
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker.errors import ConfigError

if TYPE_CHECKING:
    from supervisor.fleetconfig import FleetConfig

HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
HOSTS_BUCKET = "corral_hosts"  # KV: each live host's status (TTL fleet.host_ttl_s)
MEMBERS_BUCKET = "corral_members"  # KV: every host that registered; dead ones marked
OBJECTS_BUCKET = "corral_trees"  # object store: agents' bundles and generations


@dataclass(frozen=True)
class FleetSettings:
    host: str
    urls: tuple[str, ...]
    creds: str | None = None  # NATS credentials file (JWT + nkey seed)
    nkey_seed: str | None = None  # nkey seed file
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    replicas: int = 3
    publish_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not HOST_NAME.match(self.host):
            raise ConfigError(f"fleet host {self.host!r}: letters, digits, _ and - only")
        if not self.urls:
            raise ConfigError("fleet mode needs at least one cluster URL")
        for url in self.urls:
            if "@" in url:
                raise ConfigError("a fleet URL may not carry credentials: use a creds file")


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The writer's fleet options (the supervisor passes them from `fleet:`)."""
    group = parser.add_argument_group("fleet mode (docs/fleet.md)")
    group.add_argument("--fleet-host", default=None, help="this host's name: fleet mode on")
    group.add_argument("--fleet-url", action="append", default=[], help="a cluster URL")
    group.add_argument("--fleet-creds", default=None, help="NATS credentials file")
    group.add_argument("--fleet-nkey", default=None, help="NATS nkey seed file")
    group.add_argument("--fleet-tls-ca", default=None)
    group.add_argument("--fleet-tls-cert", default=None)
    group.add_argument("--fleet-tls-key", default=None)
    group.add_argument("--fleet-replicas", type=int, default=3)
    group.add_argument("--fleet-publish-timeout-s", type=float, default=2.0)


def settings_from_args(args: argparse.Namespace) -> FleetSettings | None:
    if args.fleet_host is None:
        return None
    return FleetSettings(
        host=args.fleet_host, urls=tuple(args.fleet_url), creds=args.fleet_creds,
        nkey_seed=args.fleet_nkey, tls_ca=args.fleet_tls_ca, tls_cert=args.fleet_tls_cert,
        tls_key=args.fleet_tls_key, replicas=args.fleet_replicas,
        publish_timeout_s=args.fleet_publish_timeout_s)


def connect_options(settings: FleetSettings, name: str) -> dict[str, Any]:
    """nats.connect() keyword options for these settings (reconnecting forever)."""
    options: dict[str, Any] = {
        "servers": list(settings.urls),
        "name": name,
        "connect_timeout": 1,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
    }
    if settings.creds:
        options["user_credentials"] = settings.creds
    if settings.nkey_seed:
        options["nkeys_seed"] = settings.nkey_seed
    if settings.tls_ca or settings.tls_cert:
        import ssl  # noqa: PLC0415 - only a TLS fleet pays for it (every writer imports this)

        ctx = ssl.create_default_context(cafile=settings.tls_ca)
        if settings.tls_cert:
            ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
        options["tls"] = ctx
    return options


async def kv_entries(js: Any, bucket: str) -> dict[str, bytes]:
    """Key -> value of a KV bucket's live entries, the keys from its stream's
    per-subject state (one request), deleted and purged keys left out. nats-py's
    `keys()` runs a watcher that, on a loaded server, may answer "no keys" for
    a bucket that has some. An absent bucket has none."""
    from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError  # noqa: PLC0415

    prefix = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    except NotFoundError:
        return {}
    if not info.state.subjects:
        return {}
    kv = await js.key_value(bucket)
    entries: dict[str, bytes] = {}
    for subject in sorted(info.state.subjects):
        key = subject.removeprefix(prefix)
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue  # expired or deleted meanwhile
        entries[key] = bytes(entry.value or b"")
    return entries


def control_subject(host: str) -> str:
    return f"corral.ctl.{host}"


def settings_of(config: FleetConfig) -> FleetSettings:
    assert config.host is not None
    return FleetSettings(host=config.host, urls=tuple(config.urls), creds=config.creds,
                         nkey_seed=config.nkey_seed, tls_ca=config.tls.ca,
                         tls_cert=config.tls.cert, tls_key=config.tls.key,
                         replicas=config.replicas,
                         publish_timeout_s=config.publish_timeout_s)
