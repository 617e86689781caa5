"""The broker's bridge between hosts over NATS, in fleet mode only.

Frames crossing hosts are authenticated (bus-key MAC and host signature),
never trusted because they came from NATS. See docs/fleet.md ("Messages
between hosts").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from broker import auth, protocol, ratelimit
from broker.errors import ProtocolError
from broker.hooks import FORWARDED, Forwarded, Local, Refusal
from broker.statedir import NAME_PATTERN
from supervisor.fleet import buskeys, operatorsig
from supervisor.fleet.natsclient import (
    HOST_NAME,
    HOSTS_BUCKET,
    MEMBERS_BUCKET,
    FleetSettings,
    add_fleet_arguments,
    connect_options,
    kv_entries,
    settings_from_args,
)

if TYPE_CHECKING:
    import argparse

    from broker.statedir import StateDir

log = structlog.get_logger("supervisor.fleet.bridge")

BUS_DOMAIN = b"corral-bus-v1"
MAX_SKEW_S = 30.0
NONCES_MAX = 200_000  # nonces remembered (two skews' worth): beyond, frames are refused
OUT_QUEUE = 1000  # frames waiting to be published to other hosts
INBOX_HWM = 1000  # frames from other hosts waiting for the broker's loop
SUB_PENDING_BYTES = 64 * 1024 * 1024  # the subscription's own bound (slow consumer: dropped)
HEADER_MAX = 256  # one header value
LAST_HOSTS_MAX = 100_000  # names remembered with the host they were last seen on
H_FROM, H_TO, H_TS, H_NONCE, H_MAC = ("Corral-From", "Corral-To", "Corral-Ts", "Corral-Nonce",
                                      "Corral-Mac")
H_SIG = "Corral-Sig"  # the sending host's own signature (supervisor/fleet/buskeys.py)
_INPROC = itertools.count()


def bus_subject(host: str) -> str:
    return f"corral.bus.{host}"


def bus_key(fleet_key: bytes) -> bytes:
    """The key frames between hosts are MACed with, from the hosts' bus secret."""
    return hmac.new(fleet_key, BUS_DOMAIN, hashlib.sha256).digest()


def _signed(sender: str, to: str, ts: str, nonce: str, body: bytes) -> bytes:
    return "\n".join((BUS_DOMAIN.decode(), sender, to, ts, nonce, "")).encode() + body


def _mac(key: bytes, sender: str, to: str, ts: str, nonce: str,  # noqa: PLR0917
         body: bytes) -> str:
    return hmac.new(key, _signed(sender, to, ts, nonce, body), hashlib.sha256).hexdigest()


def sign(key: bytes, sender: str, to: str, body: bytes,  # noqa: PLR0917
         now: float | None = None, host_key: Any = None
         ) -> dict[str, str]:
    """The NATS headers of one frame from `sender` to `to` (both `HOST:NAME`):
    the fleet's MAC, and the sending host's own signature (`host_key`)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    headers = {H_FROM: sender, H_TO: to, H_TS: ts, H_NONCE: nonce,
               H_MAC: _mac(key, sender, to, ts, nonce, body)}
    if host_key is not None:
        headers[H_SIG] = buskeys.signature(host_key, _signed(sender, to, ts, nonce, body))
    return headers


class BusRefusedError(Exception):
    """A frame from another host refused before delivery (the reason is the message)."""


def split_name(qualified: str) -> tuple[str, str] | None:
    """`HOST:NAME` -> (host, name), or None when either part is malformed."""
    host, sep, name = qualified.partition(":")
    if not sep or not HOST_NAME.fullmatch(host) or not NAME_PATTERN.fullmatch(name):
        return None
    return host, name


def verify(key: bytes, host: str, headers: dict[str, str], body: bytes,  # noqa: PLR0917
           seen: dict[str, float], max_body: int, now: float,
           pins: buskeys.Pins | None = None) -> tuple[str, str]:
    """(the sender `HOST:NAME`, the local recipient's name), or BusRefusedError.
    With `pins`, the claimed sending host's own key must have signed it."""
    if len(body) > max_body:
        raise BusRefusedError(f"body of {len(body)} bytes over the limit {max_body}")
    values = [headers.get(h) for h in (H_FROM, H_TO, H_TS, H_NONCE, H_MAC)]
    if not all(isinstance(v, str) and 0 < len(v) <= HEADER_MAX for v in values):
        raise BusRefusedError("unsigned or malformed envelope")
    sender, to, ts_text, nonce, mac = (str(v) for v in values)
    if not hmac.compare_digest(mac, _mac(key, sender, to, ts_text, nonce, body)):
        raise BusRefusedError("bad signature: not signed with the fleet's bus key")
    if pins is not None:
        claimed = sender.partition(":")[0]
        public = pins.get(claimed)
        if public is None:
            raise BusRefusedError(f"no bus key known for host {claimed[:64]}")
        sig = headers.get(H_SIG)
        if not isinstance(sig, str) or not buskeys.verified(
                public, sig, _signed(sender, to, ts_text, nonce, body)):
            raise BusRefusedError(f"not signed by host {claimed[:64]}'s own key")
    try:
        ts = float(ts_text)
    except ValueError:
        raise BusRefusedError("bad timestamp") from None
    if not math.isfinite(ts) or abs(now - ts) > MAX_SKEW_S:
        raise BusRefusedError("stale or future timestamp")
    while seen:
        oldest = next(iter(seen))
        if now - seen[oldest] <= 2 * MAX_SKEW_S:
            break
        del seen[oldest]
    if nonce in seen:
        raise BusRefusedError("replayed frame")
    if len(seen) >= NONCES_MAX:
        raise BusRefusedError("too many frames in the replay window")
    seen[nonce] = now
    origin, target = split_name(sender), split_name(to)
    if origin is None or target is None:
        raise BusRefusedError("sender or recipient is not HOST:NAME")
    if target[0] != host:
        raise BusRefusedError(f"addressed to host {target[0]!r}, this is {host!r}")
    if origin[0] == host:
        raise BusRefusedError("a frame from this host itself")
    return sender, target[1]


@dataclass(frozen=True)
class Target:
    host: str
    name: str


@dataclass(frozen=True)
class View:
    """What the fleet view says, as last read: live hosts and their agents."""

    live: frozenset[str] = frozenset()
    dead: dict[str, str] = field(default_factory=dict)  # host -> who fenced it
    silent: frozenset[str] = frozenset()  # members whose status entry expired
    agents: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> live hosts
    last_host: dict[str, str] = field(default_factory=dict)  # name -> last host it was on


def read_view(hosts: dict[str, dict[str, Any]], members: dict[str, dict[str, Any]],
              previous: View) -> View:
    """The view from the KV entries (`corral_hosts` and `corral_members`)."""
    agents: dict[str, list[str]] = {}
    for host, entry in hosts.items():
        for child in entry.get("children") or []:
            if not isinstance(child, dict) or child.get("kind") != "agent" \
                    or child.get("state") in ("stopped", "exited", "fatal"):
                continue
            name = child.get("name")
            if isinstance(name, str) and NAME_PATTERN.fullmatch(name):
                agents.setdefault(name, []).append(host)
    dead = {h: str(m.get("fenced_by")) for h, m in members.items() if m.get("dead")}
    live = frozenset(h for h in hosts if h not in dead)
    last_host = {**previous.last_host, **{n: hs[0] for n, hs in agents.items()}}
    if len(last_host) > LAST_HOSTS_MAX:  # bounded: forget the names no live host has
        last_host = {n: hs[0] for n, hs in agents.items()}
    return View(live=live, dead=dead, silent=frozenset(set(members) - set(hosts) - set(dead)),
                agents={n: tuple(sorted(hs)) for n, hs in agents.items()}, last_host=last_host)


class Bridge:
    """One broker's bridge (see the module docstring)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], settings: FleetSettings,  # noqa: PLR0917
                 fleet_key: bytes, max_body: int, view_interval_s: float = 1.0,
                 host_key: Any = None, operator_public: str | None = None) -> None:
        self.host = settings.host
        self._operator_public = operator_public  # None: no forget-bus-key taken
        self._forget_seen = operatorsig.Nonces()  # the operator's nonces (replays refused,
        # also across a restart of this broker)
        self.key_registered = False  # this host's key is the one under its name
        self._host_key = host_key  # None: frames carry the fleet's MAC only (no pins)
        self.pins = buskeys.Pins() if host_key is not None else None
        self._public = buskeys.public_hex(host_key) if host_key is not None else ""
        self.settings = settings
        self.max_body = max_body
        self.view_interval_s = view_interval_s
        self._key = bus_key(fleet_key)
        self._ctx = ctx
        self._endpoint = f"inproc://corral-bridge-{next(_INPROC)}"
        self.inbox = ctx.socket(zmq.PULL)  # read by the broker's loop only
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.RCVHWM, INBOX_HWM)
        self.inbox.bind(self._endpoint)
        self.view: View | None = None  # replaced whole by the bridge's thread
        self._out = threading.BoundedSemaphore(OUT_QUEUE)
        self._seen: dict[str, float] = {}
        self._push: zmq.Socket[bytes] | None = None
        self._nc: Any = None
        self._max_payload = max_body + 4096
        self._limiter = ratelimit.LogLimiter(log.warning)
        self._loop = asyncio.new_event_loop()
        # frames to other hosts, in the order the broker routed them (one sender task)
        self._queue: asyncio.Queue[tuple[str, str, str, bytes]] = asyncio.Queue()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-bridge",
                                        daemon=True)
        # counters (each written by one thread)
        self.sent_total = 0  # frames published to other hosts
        self.received_total = 0  # frames from other hosts handed to the broker
        self.refused_total = 0  # frames from other hosts refused (unauthenticated...)
        self.unreachable_total = 0  # frames for a dead, silent or unknown host
        self.dropped_total = 0  # publishes that failed (cluster away)
        self.bounced_total = 0  # error replies sent back to another host

    # --- the broker's thread ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._main(), self._loop)

    def resolve(self, to: bytes) -> Target | Refusal | None:
        """Where a frame for `to` (a name with no local route) goes: another
        host, this host (`HOST:NAME` naming it), a refusal, or None (not the
        bridge's: the broker answers as it would without it)."""
        try:
            text = to.decode("ascii")
        except UnicodeDecodeError:
            return None
        view = self.view
        if ":" in text:
            parts = split_name(text)
            if parts is None:
                return Refusal(protocol.ErrorCode.MALFORMED_FRAME,
                               f"recipient {text[:140]!r} is neither an actor name nor HOST:NAME")
            host, name = parts
            if host == self.host:
                return Target(host, name)
            return self._host_refusal(host, view) or Target(host, name)
        if view is None or not NAME_PATTERN.fullmatch(text) or text in auth.RESERVED:
            return None
        hosts = [h for h in view.agents.get(text, ()) if h != self.host]
        if len(hosts) == 1:
            return self._host_refusal(hosts[0], view) or Target(hosts[0], text)
        if len(hosts) > 1:
            return Refusal(protocol.ErrorCode.UNKNOWN_RECIPIENT,
                           f"{text!r} runs on several hosts ({', '.join(hosts)}): "
                           "address it as HOST:NAME")
        last = view.last_host.get(text)
        if last is not None and last != self.host and last not in view.live:
            return self._host_refusal(last, view)
        return None

    def route(self, sender: bytes, to: bytes, body: bytes) -> Local | Refusal | Forwarded | None:
        """The broker's route hook (broker/hooks.py): `resolve`, then `publish`."""
        target = self.resolve(to)
        if target is None or isinstance(target, Refusal):
            return target
        if target.host == self.host:
            return Local(target.name.encode())  # HOST:NAME naming this host
        return self.publish(target, sender, body) or FORWARDED

    def undeliverable(self, to: bytes, sender: bytes, body: bytes,
                      code: protocol.ErrorCode) -> None:
        """The broker could not deliver a frame from another host: `bounce` it."""
        name = to.decode("ascii", "replace")
        self.bounce(to, sender, body, code,
                    f"no peer named {name!r} is connected on host {self.host}"
                    if code is protocol.ErrorCode.UNKNOWN_RECIPIENT else
                    f"the queue to {name!r} is full")

    def _host_refusal(self, host: str, view: View | None) -> Refusal | None:
        if view is not None and host in view.live:
            return None
        self.unreachable_total += 1
        if view is None:
            why = "the fleet view is not loaded yet (is the cluster reachable?)"
        elif host in view.dead:
            why = f"declared dead (fenced by {view.dead[host]})"
        elif host in view.silent:
            why = "silent: its status entry expired"
        else:
            why = "no such host in the fleet"
        return Refusal(protocol.ErrorCode.HOST_UNREACHABLE, f"host {host!r}: {why}")

    def publish(self, target: Target, sender: bytes, body: bytes) -> Refusal | None:
        """Queue the frame for `target`'s host; a Refusal when it cannot go."""
        if len(body) + 2048 > self._max_payload:
            return Refusal(protocol.ErrorCode.FRAME_TOO_LARGE,
                           f"{len(body)} bytes: over the cluster's max payload")
        if not self._out.acquire(blocking=False):
            return Refusal(protocol.ErrorCode.RECIPIENT_BUSY,
                           f"the queue to other hosts is full ({OUT_QUEUE}); retry later")
        name = sender.decode("ascii", "replace")
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (
            target.host, f"{self.host}:{name}", f"{target.host}:{target.name}", body))
        return None

    def bounce(self, to: bytes, sender: bytes, body: bytes, code: protocol.ErrorCode,
               detail: str) -> None:
        """A frame from another host that the broker could not deliver to `to`:
        answer its sender (unless it is a reply or a notice)."""
        self._loop.call_soon_threadsafe(self._loop.create_task, self._error_back(
            to.decode("ascii", "replace"), sender.decode("ascii", "replace"), body, code, detail))

    def values(self) -> dict[str, int | float]:
        view = self.view
        return {"bridge_sent_total": self.sent_total,
                "bridge_received_total": self.received_total,
                "bridge_refused_total": self.refused_total,
                "bridge_unreachable_total": self.unreachable_total,
                "bridge_dropped_total": self.dropped_total,
                "bridge_bounced_total": self.bounced_total,
                "bridge_hosts": len(view.live) if view is not None else 0,
                "bridge_connected": int(self._nc is not None and self._nc.is_connected)}

    def close(self) -> None:
        if self._thread.is_alive():
            async def stop() -> None:
                if self._nc is not None:
                    with contextlib.suppress(Exception):
                        await self._nc.close()
                if self._push is not None:
                    self._push.close(linger=0)
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(3)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=3)
        if self._push is not None and not self._push.closed:
            self._push.close(linger=0)  # else the context's term() would wait for it
        self.inbox.close(linger=0)

    # --- the bridge's thread ------------------------------------------------------
    async def _main(self) -> None:
        import nats  # noqa: PLC0415 - the fleet extra

        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, INBOX_HWM)
        self._push.connect(self._endpoint)

        async def quiet(_exc: Exception) -> None:
            """nats-py prints connection errors; the counters and the view say it."""

        while True:
            try:
                self._nc = await nats.connect(
                    **connect_options(self.settings, f"corral-broker-{self.host}"),
                    error_cb=quiet)
                break
            except Exception as exc:  # noqa: BLE001 - the cluster is away: try again
                log.warning("bridge_connect_failed", error=type(exc).__name__)
                await asyncio.sleep(1)
        self._max_payload = int(self._nc.max_payload)
        await self._nc.subscribe(bus_subject(self.host), cb=self._on_frame,
                                 pending_bytes_limit=SUB_PENDING_BYTES)
        log.info("bridge_started", host=self.host, subject=bus_subject(self.host))
        sender = asyncio.get_running_loop().create_task(self._sender())
        js = self._nc.jetstream(timeout=5)
        if self.pins is not None and self._operator_public is not None:
            await self._nc.subscribe(buskeys.FORGET_SUBJECT, cb=self._on_forget)
        if self._host_key is not None:
            await self._register(js)
        while True:
            try:
                if self._host_key is not None and not self.key_registered:
                    await self._register(js, retry=False)  # cleared by the operator?
                if self.pins is not None:
                    generation = self.pins.generation
                    entries = await kv_entries(js, buskeys.BUCKET)
                    self.pins.update(entries, generation)
                    if self._host_key is not None and self.key_registered and \
                            entries.get(self.host) != self._public.encode():
                        log.warning("bus_key_gone", host=self.host)  # purged: register again
                        self.key_registered = False
                self.view = read_view(await _entries(js, HOSTS_BUCKET),
                                      await _entries(js, MEMBERS_BUCKET),
                                      self.view or View())
            except Exception as exc:  # noqa: BLE001 - the cluster is away: try again
                if self._limiter.allow():
                    log.warning("bridge_view_failed", error=type(exc).__name__)
            if sender.done():  # never: the sender task ends only when cancelled
                sender = asyncio.get_running_loop().create_task(self._sender())
            await asyncio.sleep(self.view_interval_s)

    async def _register(self, js: Any, retry: bool = True) -> None:
        """This host's public key in the bus keys bucket (retried until the
        cluster answers). Another key under this host's name (its state
        directory was wiped) is logged once, and the registration is tried
        again every view round: the other hosts refuse this host's frames
        until the operator clears the name (`supervisor fleet
        forget-bus-key`), then this key takes it."""
        assert self._host_key is not None
        public = buskeys.public_hex(self._host_key)
        while True:
            try:
                ours = await buskeys.register(js, self.host, public, self.settings.replicas)
            except Exception as exc:
                if not retry:  # the view round logs it
                    raise
                log.warning("bus_key_register_failed", error=type(exc).__name__)
                await asyncio.sleep(1)
                continue
            if ours and not self.key_registered:
                log.info("bus_key_registered", host=self.host, public=public[:16])
            elif not ours and retry:
                log.error("bus_key_conflict", host=self.host, public=public[:16],
                          fix=f"the operator runs: supervisor fleet forget-bus-key {self.host}")
            self.key_registered = ours
            return

    async def _on_forget(self, msg: Any) -> None:
        """The operator's `forget-bus-key HOST` (supervisor/fleet/buskeys.py): drop the pin
        for HOST; the next key read for it is pinned."""
        assert self.pins is not None
        try:
            host = buskeys.check_forget(bytes(msg.data or b""), self._operator_public,
                                        self._forget_seen)
        except buskeys.ForgetRefusedError as exc:
            if self._limiter.allow():
                log.warning("bus_key_forget_refused", reason=str(exc)[:200])
            reply = {"ok": False, "error": "forbidden", "detail": str(exc), "bridge": self.host}
        else:
            dropped = self.pins.forget(host)
            log.warning("bus_key_forgotten", host=host, pinned=(dropped or "")[:16])
            reply = {"ok": True, "bridge": self.host, "forgot": host,
                     "was_pinned": dropped is not None}
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(json.dumps(reply).encode())

    async def _sender(self) -> None:
        """Publish the frames the broker queued, one after the other (in order)."""
        while True:
            host, sender, to, body = await self._queue.get()
            try:
                await self._nc.publish(bus_subject(host), body,
                                       headers=sign(self._key, sender, to, body,
                                                    host_key=self._host_key))
                self.sent_total += 1
            except Exception as exc:  # noqa: BLE001 - the cluster is away: try again
                self.dropped_total += 1
                if self._limiter.allow():
                    log.warning("bridge_publish_failed", host=host, error=type(exc).__name__)
            finally:
                self._out.release()

    async def _on_frame(self, msg: Any) -> None:
        body = bytes(msg.data or b"")
        try:
            sender, to = verify(self._key, self.host, dict(msg.headers or {}), body,
                                self._seen, self.max_body, time.time(), self.pins)
        except BusRefusedError as exc:
            self.refused_total += 1
            if self._limiter.allow():
                log.warning("bridge_frame_refused", reason=str(exc)[:200],
                            claimed_from=str((msg.headers or {}).get(H_FROM, ""))[:140],
                            bytes=len(body), refused_total=self.refused_total)
            return
        if to in auth.RESERVED and not (to == auth.SUBAGENTS and sender.endswith(":subagents")):
            # (one host's subagents actor to another's: remote children, docs/fleet.md)
            await self._error_back(to, sender, body, protocol.ErrorCode.FORBIDDEN,
                                   f"{to} serves only its own host's actors")
            return
        assert self._push is not None
        try:
            self._push.send_multipart([to.encode(), sender.encode(), body], zmq.NOBLOCK)
            self.received_total += 1
        except zmq.Again:
            await self._error_back(to, sender, body, protocol.ErrorCode.RECIPIENT_BUSY,
                                   f"host {self.host}'s broker is busy; retry later")

    async def _error_back(self, local: str, remote: str, body: bytes,
                          code: protocol.ErrorCode, detail: str) -> None:
        peeked = protocol.peek(body)
        if peeked.is_reply or split_name(remote) is None:
            return  # never answer a reply (an error above all) with an error
        frame = protocol.error_frame(ProtocolError(code.value, detail), peeked.msg_id)
        host = remote.partition(":")[0]
        try:
            await self._nc.publish(bus_subject(host), frame,
                                   headers=sign(self._key, f"{self.host}:{local}", remote, frame,
                                                host_key=self._host_key))
            self.bounced_total += 1
        except Exception:  # noqa: BLE001 - nobody left to tell: its request times out
            self.dropped_total += 1


async def _entries(js: Any, bucket: str) -> dict[str, dict[str, Any]]:
    """Every live entry of a KV bucket, parsed (an absent bucket: none)."""
    found: dict[str, dict[str, Any]] = {}
    for key, value in (await kv_entries(js, bucket)).items():
        try:
            data = json.loads(value or b"{}")
        except ValueError:
            continue  # not ours
        if isinstance(data, dict):
            found[key] = data
    return found


def from_args(ctx: zmq.Context[zmq.Socket[bytes]], settings: FleetSettings | None,  # noqa: PLR0917
              key_path: str | None, max_body: int, view_interval_s: float,
              host_key_path: Path | None = None,
              operator_public_path: str | None = None) -> Bridge | None:
    """The started bridge in fleet mode with the hosts' bus secret (`key_path`),
    else None (logged). With the operator's public key it takes the
    operator's `forget-bus-key`."""
    if settings is None:
        return None
    key = b""
    if key_path:
        try:
            with open(key_path, "rb") as f:
                key = f.read().strip()
        except OSError as exc:
            log.error("bridge_off", reason=f"bus secret unreadable: {type(exc).__name__}")
            return None
    if not key:
        log.warning("bridge_off", reason="no fleet.bus_secret: frames cannot be signed")
        return None
    operator_public = None
    if operator_public_path:
        try:
            operator_public = operatorsig.load_public(Path(operator_public_path))
        except (OSError, ValueError) as exc:
            log.error("bus_key_forget_off", reason=str(exc)[:200])
    host_key = None
    if host_key_path is not None:
        try:
            host_key = buskeys.load_or_create(host_key_path)
        except (OSError, ValueError) as exc:
            log.error("bridge_off", reason=f"host bus key unusable: {type(exc).__name__}")
            return None
    bridge = Bridge(ctx, settings, key, max_body, view_interval_s, host_key, operator_public)
    bridge.start()
    return bridge


# --- the broker's hook (broker/hooks.py): `--hook supervisor.fleet.bridge` ----------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The broker's fleet options (the supervisor passes them from `fleet:`)."""
    add_fleet_arguments(parser)
    parser.add_argument("--fleet-bus-secret", default=None,
                        help="the hosts' bus secret file (frames between hosts are MACed)")
    parser.add_argument("--fleet-operator-public-key", default=None,
                        help="the operator's public key file (forget-bus-key is verified)")
    parser.add_argument("--fleet-view-interval-s", type=float, default=1.0)


def route_hook(ctx: zmq.Context[zmq.Socket[bytes]], args: argparse.Namespace, state: StateDir,
               limits: protocol.Limits) -> Bridge | None:
    """The broker's route hook: the started bridge, or None (`from_args`)."""
    return from_args(ctx, settings_from_args(args), args.fleet_bus_secret,
                     limits.max_frame_bytes, args.fleet_view_interval_s,
                     buskeys.key_path(state.root), args.fleet_operator_public_key)
