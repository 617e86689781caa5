"""`supervisor fleet ...`: the local development cluster and fleet operations.

    supervisor fleet up [--nodes 3] | down | fence HOST | forget-bus-key HOST

See docs/fleet.md ("Set-up", "Fencing", "Messages between hosts").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from broker.errors import ConfigError
from broker.statedir import StateDir
from supervisor.fleet.natsclient import FleetSettings, connect_options
from supervisor.fleet.replicate import fence_subject, stream_name

PROG = "supervisor fleet"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="start a local JetStream cluster under .corral/fleet/")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--state-dir", default=None)
    up.add_argument("--json", action="store_true")
    down = sub.add_parser("down", help="stop the local cluster")
    down.add_argument("--state-dir", default=None)
    fence = sub.add_parser("fence", help="fence a host (docs/fleet.md, host loss)")
    fence.add_argument("host")
    fence.add_argument("--by", default="operator")
    fence.add_argument("--config", default=None, help="a configuration naming fleet.urls")
    fence.add_argument("--url", action="append", default=[])
    forget = sub.add_parser("forget-bus-key", help="clear a wiped host's bus key (operator)")
    forget.add_argument("host")
    forget.add_argument("--config", default=None, help="a configuration naming fleet.urls")
    forget.add_argument("--url", action="append", default=[])
    forget.add_argument("--state-dir", default=None, help="a host's (its run/fleet.json)")
    forget.add_argument("--operator-key", default=None,
                        help="the operator's private key file (default: $CORRAL_OPERATOR_KEY)")
    forget.add_argument("--wait-s", type=float, default=3.0,
                        help="how long to await the bridges' answers")
    forget.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.verb == "up":
            return _up(args)
        if args.verb == "down":
            from supervisor.fleet import cluster  # noqa: PLC0415

            count = cluster.down(StateDir.resolve(args.state_dir).root)
            print(f"{PROG}: stopped {count} node(s)")
            return 0
        if args.verb == "forget-bus-key":
            from supervisor.fleet import forget  # noqa: PLC0415

            return forget.main(args)
        return _fence(args)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    from supervisor.fleet import buskeys, cluster, operatorsig  # noqa: PLC0415

    root = StateDir.resolve(args.state_dir).ensure().root
    nodes = cluster.up(root, args.nodes)
    urls = [n.url for n in nodes]
    directory = cluster.fleet_dir(root)
    private, public = operatorsig.make_keys(directory)
    secret = buskeys.make_bus_secret(directory / "bus.secret")
    if args.json:
        print(json.dumps({"urls": urls, "pids": [n.pid for n in nodes], "dir": str(directory),
                          "operator_key": str(private), "operator_public_key": str(public),
                          "bus_secret": str(secret)}))
    else:
        print(f"{PROG}: {len(nodes)} node(s) up: {' '.join(urls)}")
        print("  configure hosts with: fleet: {host: NAME, urls: [" + ", ".join(urls) + "], "
              f"operator_public_key: {public}, bus_secret: {secret}}}")
        print(f"  the operator signs with: export CORRAL_OPERATOR_KEY={private}")
    return 0


def _fence(args: argparse.Namespace) -> int:
    urls = list(args.url)
    settings: dict[str, Any] = {}
    if args.config:
        from supervisor.config import load  # noqa: PLC0415

        fleet = load(Path(args.config)).fleet
        urls = urls or list(fleet.urls)
        settings = {"creds": fleet.creds, "nkey_seed": fleet.nkey_seed, "tls_ca": fleet.tls.ca,
                    "tls_cert": fleet.tls.cert, "tls_key": fleet.tls.key}
    seq = asyncio.run(fence(FleetSettings(host=args.host, urls=tuple(urls), **settings),
                            args.by))
    print(f"{PROG}: host {args.host} fenced (stream sequence {seq})")
    return 0


async def fence(settings: FleetSettings, by: str) -> int:
    """Append the fence to `settings.host`'s stream: its writer's next publish
    fails its expected-last-sequence, reads the fence, and stops (exit 77)."""
    import time  # noqa: PLC0415

    import nats  # noqa: PLC0415

    options = connect_options(settings, f"corral-fence-{by}")
    # one attempt per server: nats-py 2.16 retries an initial connect forever with
    # max_reconnect_attempts=0 (a command on a cluster that is away never returned)
    options.update(allow_reconnect=False, max_reconnect_attempts=1, error_cb=_quiet)
    nc = await nats.connect(**options)
    try:
        js = nc.jetstream(timeout=settings.publish_timeout_s * 5)
        ack = await js.publish(fence_subject(settings.host), b"",
                               stream=stream_name(settings.host),
                               headers={"Corral-Fence": f"by {by} at {time.time():.3f}"})
        return int(ack.seq)
    finally:
        await nc.close()


async def _quiet(exc: Exception) -> None:
    """nats-py prints every connection error by default; a failure reaches the caller."""
