"""The fleet's operator commands across hosts: `status --fleet`, signed requests.

See docs/fleet.md ("One view") and docs/security.md ("Fleet control (fleet
mode)").
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal as signals
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.durable import write_atomic
from broker.errors import ConfigError
from broker.statedir import StateDir
from supervisor.fleet import operatorsig
from supervisor.fleet.natsclient import connect_options, control_subject, settings_of
from supervisor.fleet.view import least_loaded, read_hosts
from supervisor.fleetconfig import OPERATOR_KEY_ENV, FleetConfig

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from broker import protocol

MAX_SKEW_S = 30.0
AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
VERBS = ("kill", "stop", "start", "spawn")
REQUIRED = frozenset({"verb", "host", "agent", "signal", "ts", "nonce"})
SPAWN_FIELDS = frozenset({"task", "model"})  # spawn only: the task file's text, --model
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_ANSWER = 0, 1, 2, 4


class FleetControlError(Exception):
    """A control request refused (its reason is in the message)."""


def sign(key: Ed25519PrivateKey, verb: str, host: str, agent: str,
         sig: int = signals.SIGTERM, **extra: str | None) -> bytes:
    """A control request signed with the operator's private key."""
    return operatorsig.sign(key, {"verb": verb, "host": host, "agent": agent, "signal": sig,
                                  **extra})


def verify(data: bytes, host: str, public: str | None,
           seen: dict[str, float]) -> dict[str, Any]:
    """The checked request, or FleetControlError. `public` is the operator's
    public key (hex); `seen` remembers nonces."""
    try:
        request = operatorsig.verify(data, public, seen)
    except operatorsig.SignatureRefusedError as exc:
        raise FleetControlError(str(exc)) from None
    if not set(request) >= REQUIRED or not set(request) - REQUIRED <= SPAWN_FIELDS:
        raise FleetControlError("malformed request")
    if request["host"] != host:
        raise FleetControlError(f"addressed to {request['host']!r}, this is {host!r}")
    if request["verb"] not in VERBS:
        raise FleetControlError(f"unknown verb {request['verb']!r}")
    if not isinstance(request["agent"], str) or not AGENT_NAME.match(request["agent"]):
        raise FleetControlError("not an actor name")
    if not isinstance(request["signal"], int) or isinstance(request["signal"], bool) \
            or not 1 <= request["signal"] <= 64:
        raise FleetControlError("bad signal")
    if request["verb"] == "spawn" and not isinstance(request.get("task"), str):
        raise FleetControlError("spawn needs the task file's text")
    if not isinstance(request.get("model"), str | None):
        raise FleetControlError("bad model")
    return request


def operator_key(given: str | None = None) -> Ed25519PrivateKey:
    """The operator's private key, from the file `given` or else the one
    `CORRAL_OPERATOR_KEY` names (ConfigError when neither or unusable: fleet
    control needs it)."""
    path = given or os.environ.get(OPERATOR_KEY_ENV)
    if not path:
        raise ConfigError(f"{OPERATOR_KEY_ENV} is not set: fleet control needs the operator's "
                          "private key (a file `supervisor fleet up` makes: fleet/operator.key)")
    try:
        return operatorsig.load_private(Path(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{(given and 'operator key') or OPERATOR_KEY_ENV}: {exc}") from None


def carry_out(state_dir: StateDir, request: dict[str, Any]) -> dict[str, Any]:
    """Ask this host's control socket, as its operator (blocking)."""
    from broker import protocol  # noqa: PLC0415
    from broker.errors import CorralError, RemoteError  # noqa: PLC0415
    from broker.requester import new_msg_id  # noqa: PLC0415
    from supervisor import client  # noqa: PLC0415

    agent = request["agent"]
    message: client.Request
    if request["verb"] == "spawn":
        try:
            message = _spawn_message(state_dir, agent, request["task"], request.get("model"))
            if isinstance(request.get("session"), str):  # an adoption (adopt.py) only
                message = message.model_copy(update={"session": request["session"]})
        except (CorralError, ValueError) as exc:
            return {"ok": False, "error": "task", "detail": str(exc).splitlines()[0]}
    elif request["verb"] == "kill":
        message = protocol.SignalRequest(msg_id=new_msg_id("fk"), target=agent,
                                         signal=request["signal"])
    elif request["verb"] == "stop":
        message = protocol.StopRequest(msg_id=new_msg_id("fs"), target=agent)
    else:
        message = protocol.StartRequest(msg_id=new_msg_id("fa"), target=agent)
    try:
        reply = client.ask(state_dir, message, timeout_s=5)
    except RemoteError as exc:
        return {"ok": False, "error": exc.code, "detail": exc.detail}
    except CorralError as exc:
        return {"ok": False, "error": "failed", "detail": str(exc)}
    return {"ok": True, "affected": list(getattr(reply, "affected", []) or [agent])}


def _spawn_message(state_dir: StateDir, agent: str, task: str,
                   model: str | None) -> protocol.SpawnRequest:
    """The task text written under this host's state directory, checked, and the
    SpawnRequest naming it (as `supervisor spawn` on this host would send)."""
    from actors.kernel.settings import load_task, parse_model  # noqa: PLC0415
    from broker import protocol  # noqa: PLC0415
    from broker.requester import new_msg_id  # noqa: PLC0415

    chosen = parse_model(model)
    directory = state_dir.root / "fleet-tasks"
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{agent}.yaml"
    write_atomic(path, task.encode())
    load_task(path)
    return protocol.SpawnRequest(msg_id=new_msg_id("fsp"), name=agent, task=str(path),
                                 backend=chosen["backend"], model=chosen.get("model"),
                                 replay_stream=chosen.get("replay_stream"))


def remote_spawn(state_dir: StateDir, config_path: str | None, name: str, task_file: str,
                 model: str | None, *, host: str, as_json: bool) -> int:
    """`supervisor spawn NAME --task FILE --host auto|HOST`: HOST, or the
    least-loaded live host in the fleet view that accepts it."""
    try:
        config = fleet_config(state_dir, config_path)
        key = operator_key()
        task = Path(task_file).read_text(encoding="utf-8")
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE

    placed = _place(config, key, name, task, model) if host == "auto" else None
    candidates = [] if placed is not None else \
        least_loaded(fleet_status(config)) if host == "auto" else [host]

    async def ask(target: str) -> dict[str, Any]:
        nc = await _connect(config)
        try:
            msg = await nc.request(control_subject(target),
                                   sign(key, "spawn", target, name, task=task, model=model),
                                   timeout=10)
            reply: dict[str, Any] = json.loads(msg.data)
            return reply
        finally:
            await nc.close()

    reply: dict[str, Any] = placed or {"ok": False, "error": "no_host", "detail": "no live host"}
    for target in candidates:
        try:
            reply = asyncio.run(ask(target))
        except Exception as exc:  # noqa: BLE001 - no responder, timeout: try the next
            reply = {"ok": False, "error": "no_answer", "detail": type(exc).__name__}
        reply["host"] = target
        if reply.get("ok") or host != "auto" or reply.get("error") == "task":
            break
    if as_json:
        print(json.dumps({"command": "spawn", "target": name, **reply}))
    elif reply.get("ok"):
        print(f"supervisor: spawned {name} on {reply['host']}")
    else:
        print(f"supervisor: spawn {name} refused: {reply.get('error')}: {reply.get('detail')}",
              file=sys.stderr)
    return EXIT_OK if reply.get("ok") else EXIT_FAILED


def _place(config: FleetConfig, key: Ed25519PrivateKey, name: str, task: str,
           model: str | None) -> dict[str, Any] | None:
    """Through the hosts' queue group (supervisor/fleet/place.py): its answer,
    or None to fall back to the fleet view's order."""
    from supervisor.fleet.place import PLACE_HOST, place  # noqa: PLC0415

    async def go() -> dict[str, Any] | None:
        nc = await _connect(config)
        try:
            return await place(nc, lambda: sign(key, "spawn", PLACE_HOST, name, task=task,
                                                model=model))
        finally:
            await nc.close()

    try:
        return asyncio.run(go())
    except Exception:  # noqa: BLE001 - the cluster away: the fallback says so
        return None


# --- the CLI side ------------------------------------------------------------
def fleet_config(state_dir: StateDir, config_path: str | None) -> FleetConfig:
    """The fleet configuration: a config file's `fleet:`, else this host's run/fleet.json."""
    if config_path is not None:
        from supervisor.config import load  # noqa: PLC0415

        config = load(Path(config_path)).fleet
    else:
        path = state_dir.run_dir / "fleet.json"
        try:
            config = FleetConfig.model_validate_json(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"no fleet configuration ({path}: {exc}); pass --config") from None
    if not config.urls:
        raise ConfigError("the fleet configuration names no cluster URLs")
    return config


async def _connect(config: FleetConfig) -> Any:
    import nats  # noqa: PLC0415


    cfg = config if config.host else config.model_copy(update={"host": "operator"})
    options = connect_options(settings_of(cfg), "corral-operator")
    # one attempt per server: nats-py 2.16 retries an initial connect forever with
    # max_reconnect_attempts=0 (a command on a cluster that is away never returned)
    options.update(allow_reconnect=False, max_reconnect_attempts=1, error_cb=_quiet)
    return await nats.connect(**options)


def fleet_status(config: FleetConfig) -> list[dict[str, Any]]:
    """Every host's last status entry, with its age (and the hosts declared dead)."""

    async def go() -> list[dict[str, Any]]:
        nc = await _connect(config)
        try:
            return await read_hosts(nc.jetstream(timeout=5), config.host_ttl_s)
        finally:
            await nc.close()

    return asyncio.run(go())


def print_fleet_status(state_dir: StateDir, config_path: str | None, as_json: bool) -> int:
    try:
        config = fleet_config(state_dir, config_path)
        hosts = fleet_status(config)
    except ConfigError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the cluster is away
        print(f"supervisor: the fleet's cluster did not answer ({type(exc).__name__})",
              file=sys.stderr)
        return EXIT_NO_ANSWER
    if as_json:
        print(json.dumps({"hosts": hosts}))
        return EXIT_OK
    for host in hosts:
        mark = f"  STALE ({host['age_s']}s ago)" if host["stale"] else ""
        if host.get("unreadable"):
            mark = f"  UNKNOWN (its entry could not be read: {host['unreadable']})"
        if host.get("expired"):
            mark = f"  STALE (silent over {config.host_ttl_s:g}s: its entry expired)"
        if host.get("dead"):
            mark = f"  DEAD (fenced by {host.get('fenced_by')}, {host['age_s']}s ago)"
        print(f"{host['host']}{mark}")
        for child in host["children"]:
            print(f"  {child.get('name', '?'):24} {child.get('kind', ''):10} "
                  f"{child.get('state', '?'):10} pid {child.get('pid') or '-'}")
    if not hosts:
        print("no host has reported")
    return EXIT_OK


def remote_control(state_dir: StateDir, config_path: str | None, verb: str, target: str, *,
                   sig: int, as_json: bool) -> int:
    host, _, agent = target.partition(":")
    try:
        config = fleet_config(state_dir, config_path)
        key = operator_key()
    except (ConfigError, OSError) as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE

    async def go() -> dict[str, Any]:
        nc = await _connect(config)
        try:
            msg = await nc.request(control_subject(host), sign(key, verb, host, agent, sig),
                                   timeout=10)
            reply: dict[str, Any] = json.loads(msg.data)
            return reply
        finally:
            await nc.close()

    try:
        reply = asyncio.run(go())
    except Exception as exc:  # noqa: BLE001 - no responder, timeout, cluster away
        print(f"supervisor: host {host} did not answer ({type(exc).__name__})", file=sys.stderr)
        return EXIT_NO_ANSWER
    if as_json:
        print(json.dumps({"command": verb, "target": target, **reply}))
    elif reply.get("ok"):
        print(f"{verb} {target}: done")
    else:
        print(f"supervisor: {verb} {target} refused: {reply.get('error')}: "
              f"{reply.get('detail')}", file=sys.stderr)
    return EXIT_OK if reply.get("ok") else EXIT_FAILED


async def _quiet(exc: Exception) -> None:
    """nats-py prints every connection error by default; a failure reaches the caller."""
