"""`supervisor fleet forget-bus-key HOST`: the operator clears a wiped host's key.

See docs/fleet.md ("Messages between hosts").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

from broker.errors import ConfigError
from broker.statedir import StateDir
from supervisor.fleet import buskeys
from supervisor.fleet.ctl import (
    EXIT_FAILED,
    EXIT_NO_ANSWER,
    EXIT_OK,
    EXIT_USAGE,
    _connect,
    fleet_config,
    operator_key,
)
from supervisor.fleet.natsclient import HOST_NAME
from supervisor.fleet.view import read_hosts
from supervisor.fleetconfig import FleetConfig

PROG = "supervisor fleet forget-bus-key"


def main(args: argparse.Namespace) -> int:
    host = str(args.host)
    if not HOST_NAME.fullmatch(host):
        print(f"{PROG}: {host[:80]!r} is not a host name", file=sys.stderr)
        return EXIT_USAGE
    try:
        key = operator_key(args.operator_key)
        config = _config(args)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = asyncio.run(forget(config, key, host, float(args.wait_s)))
    except Exception as exc:  # noqa: BLE001 - the cluster is away
        print(f"{PROG}: the fleet's cluster did not answer ({type(exc).__name__})",
              file=sys.stderr)
        return EXIT_NO_ANSWER
    refused = {b: r for b, r in result["bridges"].items() if not r.get("ok")}
    code = EXIT_FAILED if refused else EXIT_NO_ANSWER if result["missing"] else EXIT_OK
    if args.json:
        print(json.dumps({"command": "forget-bus-key", "host": host, "ok": code == EXIT_OK,
                          **result}))
    else:
        done = sorted(b for b, r in result["bridges"].items() if r.get("ok"))
        print(f"{PROG}: {host}'s bus key purged; pin dropped by {', '.join(done) or 'none'}")
        for bridge, reply in sorted(refused.items()):
            print(f"  {bridge}: refused: {reply.get('detail')}", file=sys.stderr)
        if result["missing"]:
            print(f"  no answer from: {', '.join(result['missing'])}", file=sys.stderr)
    return code


def _config(args: argparse.Namespace) -> FleetConfig:
    if args.url:
        try:
            return FleetConfig(urls=list(args.url))
        except ValueError as exc:
            raise ConfigError(f"--url: {exc}") from None
    return fleet_config(StateDir.resolve(args.state_dir), args.config
                        or os.environ.get("CORRAL_FLEET_CONFIG"))


async def forget(config: FleetConfig, key: Any, host: str, wait_s: float) -> dict[str, Any]:
    """Purge, then ask every bridge; {"bridges": {bridge: answer}, "missing": [...]}."""
    nc = await _connect(config)
    try:
        js = nc.jetstream(timeout=5)
        await buskeys.purge(js, host)
        live = {h["host"] for h in await read_hosts(js, config.host_ttl_s)
                if not h["stale"] and not h.get("dead")}
        answers: dict[str, dict[str, Any]] = {}
        everyone = asyncio.Event()

        async def on_answer(msg: Any) -> None:
            try:
                reply = json.loads(msg.data)
            except ValueError:
                return
            bridge = reply.get("bridge") if isinstance(reply, dict) else None
            if isinstance(bridge, str) and HOST_NAME.fullmatch(bridge):
                answers[bridge] = reply
                if live <= set(answers):
                    everyone.set()

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=on_answer)
        await nc.publish(buskeys.FORGET_SUBJECT, buskeys.forget_request(key, host),
                         reply=inbox)
        await nc.flush()
        deadline = time.monotonic() + wait_s
        if live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(everyone.wait(), timeout=wait_s)
        else:  # no live host in the view: what answers in the wait is all there is
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        await sub.unsubscribe()
        return {"bridges": answers, "missing": sorted(live - set(answers))}
    finally:
        await nc.close()
