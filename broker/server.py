"""The broker process: one ROUTER that routes frames between actors by name.

    python -m broker.server --state-dir D [--heartbeat-interval-ms 1000] ...

Routed bodies are never decoded. docs/broker.md is the normative text.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from types import ModuleType

import structlog
import zmq

from broker import auth, curve, hooks, memtrim, protocol, ratelimit, skeleton
from broker.control import ControlReporter
from broker.curve import CurveServer, apply_server, check_endpoints
from broker.durable import write_atomic
from broker.errors import ConfigError, LockHeldError, ProtocolError, StateDirError
from broker.fdlimit import raise_fd_limit
from broker.heartbeat import HeartbeatRule, PeerTable
from broker.parking import GRACE_S, MIN_INTERVAL_S, Parking
from broker.pidlock import PidLock
from broker.statedir import NAME_PATTERN, StateDir, bind_umask

EXIT_OK = 0
EXIT_LOCKED = 75  # another broker holds run/broker.lock
EXIT_CONFIG = 78  # the state directory is unusable

BROKER_NAME = b"broker"
DRAIN_BATCH = 256  # frames handled per wake-up before housekeeping gets a turn
MAX_POLL_MS = 100  # bounds how long a stop signal waits to be noticed
ERROR_LOGS_PER_S = 10  # rejected-frame log lines per second before they are counted only
ERROR_LOGS_BURST = 50
# Frames queued per peer before the broker refuses more with recipient_busy:
# a peer that does not read holds at most this many (each <= max_frame_bytes).
SNDHWM = 1000
_NAME_CACHE_MAX = 4096
# quiet (idle) peers get one heartbeat this often: one whose connection is gone
# bounces and is forgotten (docs/broker.md, "Idle peers")
QUIET_PROBE_S = 60.0
_EVENTS = zmq.EVENTS
_RCVMORE = zmq.RCVMORE
_POLLIN = zmq.POLLIN
_NOBLOCK = zmq.NOBLOCK
_SNDMORE_NOBLOCK = zmq.SNDMORE | zmq.NOBLOCK
_USER_ID = auth.USER_ID
_OPERATOR = auth.OPERATOR

log = structlog.get_logger("broker")


@dataclass(frozen=True)
class BrokerStats:
    """The broker's counters, as `supervisor status` and `stats` show them."""

    peers: int
    routed_total: int
    errors_total: int  # error replies sent (every refusal below is one)
    rejected_total: int  # malformed frames: frame count, names, control frames
    unknown_recipient_total: int
    busy_total: int
    control_total: int  # frames addressed to the broker itself
    expired_total: int
    logs_suppressed_total: int
    unanswered_total: int  # replies/errors not answered or not deliverable (dropped)
    failures_total: int  # unexpected exceptions caught by the loop's last line of defence
    renewals_total: int  # ROUTER sockets renewed to free parked connections (broker/parking.py)
    parked_total: int  # parked connections those renewals freed

    def values(self) -> dict[str, int | float]:
        return dict(asdict(self))


class Broker:
    """The routing loop over one bound ROUTER socket."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        rule: HeartbeatRule,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        *,
        curve_server: CurveServer | None = None,
        tcp_endpoints: tuple[str, ...] = (),
        zap: auth.ZapHandler | None = None,
        route_hook: hooks.RouteHook | None = None,
        renew_interval_s: float = MIN_INTERVAL_S,
        quiet_probe_s: float = QUIET_PROBE_S,
    ) -> None:
        """With `zap` (broker/auth.py) every connection authenticates and a peer
        may use only its own name; without it, names are not checked. With
        `route_hook` (broker/hooks.py: the fleet's bridge) names with no local
        route may be elsewhere."""
        check_endpoints(tcp_endpoints, curve_server is not None)
        self._zap = zap
        self._hook = route_hook
        self.endpoint = endpoint
        self.rule = rule
        self.limits = limits
        self._pid = os.getpid()
        self._peers = PeerTable(rule)
        self._quiet_probe_s = quiet_probe_s
        self._quiet_probe_at = time.monotonic() + quiet_probe_s
        self._names: set[bytes] = set()  # validated actor names (cache for the hot path)
        self._route: dict[bytes, bytes] = {}  # actor name -> routing id of its connection
        # routing ids the broker generated (a zero byte, then 4 bytes never reused on
        # this socket) -> the name their connection authenticated as
        self._known: dict[bytes, bytes] = {}
        self._stopping = False
        self._trimmer = memtrim.Trimmer()  # freed memory back to the system after a burst
        self._routed = 0
        self._errors = 0
        self._rejected = 0
        self._unknown = 0
        self._busy = 0
        self._control = 0
        self._expired = 0
        self._unanswered = 0
        self._failures = 0
        self._limiter = ratelimit.LogLimiter(
            log.warning, rate_per_s=ERROR_LOGS_PER_S, burst=ERROR_LOGS_BURST
        )
        self._max_body = limits.max_frame_bytes
        self._ctx = ctx
        self._curve_server = curve_server
        # a peer's libzmq reconnects by itself: its next heartbeat is its first frame
        self._parking = Parking(time.monotonic(), min_interval_s=renew_interval_s,
                                grace_s=max(GRACE_S, 2 * rule.interval_s))
        self._sock, self._monitor = self._open_socket([endpoint, *tcp_endpoints])

    def _open_socket(
        self, endpoints: list[str], deadline_s: float = 0.0
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """The ROUTER bound to `endpoints` (self.bound then lists what was bound),
        and its monitor of succeeded handshakes (broker/parking.py). A renewal
        passes `deadline_s`: the old socket's tcp listener closes asynchronously,
        so a bind may find its port busy for a moment."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, SNDHWM)
        # Frames up to twice the limit arrive and are refused with a typed
        # frame_too_large; beyond that the transport drops the connection.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._max_body)
        if self._curve_server is not None:  # every connection then needs CURVE, ipc included
            apply_server(sock, self._curve_server)
        elif self._zap is not None:
            auth.apply_server(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        old = bind_umask()
        try:
            bound: list[str] = []
            for at in endpoints:
                until = time.monotonic() + deadline_s
                while True:
                    try:
                        sock.bind(at)
                        break
                    except zmq.ZMQError as exc:
                        if exc.errno != zmq.EADDRINUSE or time.monotonic() >= until:
                            sock.disable_monitor()
                            monitor.close(linger=0)
                            sock.close(linger=0)
                            raise
                        time.sleep(0.01)  # the old listener's close is asynchronous
                bound.append(at if not bound else sock.getsockopt_string(zmq.LAST_ENDPOINT))
            self.bound = bound
        finally:
            os.umask(old)
        return sock, monitor

    # --- counters -------------------------------------------------------------
    def statistics(self) -> BrokerStats:
        return BrokerStats(
            peers=len(self._peers),
            routed_total=self._routed,
            errors_total=self._errors,
            rejected_total=self._rejected,
            unknown_recipient_total=self._unknown,
            busy_total=self._busy,
            control_total=self._control,
            expired_total=self._expired,
            logs_suppressed_total=self._limiter.suppressed_total,
            unanswered_total=self._unanswered,
            failures_total=self._failures,
            renewals_total=self._parking.renewals_total,
            parked_total=self._parking.parked_total,
        )

    def values(self) -> dict[str, int | float]:
        """The counters, and the route hook's (heartbeats, `stats`)."""
        values = self.statistics().values()
        if self._hook is not None:
            values.update(self._hook.values())
        return values

    def stop(self) -> None:
        """Ask the loop to return after the current turn (signal-safe)."""
        self._stopping = True

    # --- the loop -------------------------------------------------------------
    def run(self, reporter: ControlReporter | None = None) -> None:
        """Route until stop(); housekeeping (heartbeats, expiry) between batches."""
        zap = self._zap
        sock = None
        poll_items: list[tuple[zmq.Socket[bytes], int]] = []
        poll = zmq.zmq_poll  # half the cost of Socket.poll, which builds a Poller per call
        next_beat = time.monotonic() + self.rule.interval_s
        next_report = 0.0
        report_every_s = reporter.interval_s / 2 if reporter is not None else 0.0
        while not self._stopping:
            if sock is not self._sock:  # first turn, or the socket was renewed
                sock = self._sock
                poll_items = [(sock, zmq.POLLIN), (self._monitor, zmq.POLLIN)]
                if zap is not None:
                    poll_items.append((zap.socket, zmq.POLLIN))
                if self._hook is not None:
                    poll_items.append((self._hook.inbox, zmq.POLLIN))
            timeout_ms = min(MAX_POLL_MS, max(0, int((next_beat - time.monotonic()) * 1000) + 1))
            busy = bool(poll(poll_items, timeout_ms))
            self._trimmer.tick(busy)
            if busy:
                self._handshakes()
                if zap is not None:
                    zap.handle()
                try:
                    self._drain()
                    if self._hook is not None:
                        self._from_hook()
                except Exception:  # the last line of defence: log, go on
                    self._failures += 1
                    if self._limiter.allow():
                        log.exception("frame_handling_failed", failures_total=self._failures)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.rule.interval_s
                self._housekeep(now)
            if reporter is not None and now >= next_report:
                # the reporter keeps its own pace; asking twice per interval keeps it on time
                next_report = now + report_every_s
                reporter.tick(self.values)

    def _drain(self) -> None:
        """Handle up to DRAIN_BATCH frames without blocking: the hot path.

        Plain socket calls, no decode, no logging, no exceptions in the common
        case (ZMQ_EVENTS says whether a frame waits; a raised zmq.Again costs
        more than the whole route)."""
        sock = self._sock
        recv = sock.recv
        send = sock.send
        getsockopt = sock.getsockopt
        names = self._names
        last_seen = self._peers.last_seen
        max_body = self._max_body
        check = self._zap is not None
        route_get = self._route.get
        known_get = self._known.get
        now = time.monotonic()
        for _ in range(DRAIN_BATCH):
            if not getsockopt(_EVENTS) & _POLLIN:  # type: ignore[arg-type,operator]
                break
            rid = recv(_NOBLOCK)  # the connection's routing id
            if not getsockopt(_RCVMORE):
                self._slow([rid], now)
                continue
            to = recv(_NOBLOCK)
            if not getsockopt(_RCVMORE):
                self._slow([rid, to], now)
                continue
            # the sender's name: the one its connection authenticated as, read from
            # the message's User-Id (on every frame) unless this routing id is known
            user = None
            sender = known_get(rid) if check else rid
            if sender is None:
                last = recv(_NOBLOCK, copy=False)
                body = last.bytes
                user = str(last.get(_USER_ID))
                sender = rid if user == _OPERATOR else user.encode()
            else:
                body = recv(_NOBLOCK)
            if getsockopt(_RCVMORE):
                frames = [rid, to, body, recv(_NOBLOCK)]
                while getsockopt(_RCVMORE):
                    frames.append(recv(_NOBLOCK))
                self._slow(frames, now)
                continue
            dest = route_get(to)
            if (dest is not None and route_get(sender) == rid and to in names
                    and len(body) <= max_body):
                if sender not in last_seen:
                    self._register(sender)
                last_seen[sender] = now
                try:
                    send(dest, _SNDMORE_NOBLOCK)  # ROUTER_MANDATORY fails here, if at all
                except zmq.ZMQError as exc:
                    self._route_failed(sender, to, body, exc, rid)
                    continue
                send(sender, _SNDMORE_NOBLOCK)
                send(body, _NOBLOCK)
                self._routed += 1  # now: a stats request later in this drain sees it
            else:
                self._slow([rid, to, body], now,
                           user if user is not None or not check else sender.decode())

    # --- everything that is not a plain route --------------------------------
    def _slow(self, frames: list[bytes], now: float, user: str | None = None) -> None:
        """Validate, register (name -> routing id) and route one message. A peer's
        name is the name it authenticated as (its routing id is then the
        broker's own choice); the operator's connections, and every connection
        of a broker without authentication, are named by their routing id."""
        rid = frames[0]
        self._parking.seen(rid)  # a connection's first frame always comes this way
        if len(frames) != 3:
            self._refuse(
                rid,
                frames[-1] if len(frames) > 1 else b"",
                protocol.ErrorCode.MALFORMED_FRAME,
                f"expected 2 frames [to, body], got {len(frames) - 1}",
            )
            return
        _, to, body = frames
        sender = rid if user is None or user == _OPERATOR else user.encode()
        if sender != rid and rid[:1] != b"\0":  # an identity of its own, not its name
            self._refuse(rid, body, protocol.ErrorCode.FORBIDDEN,
                         f"authenticated as {sender.decode()}, not {rid[:80]!r}: "
                         "leave ZMQ_IDENTITY unset (the broker names you)")
            return
        if not self._valid_sender(sender):
            self._refuse(
                rid,
                body,
                protocol.ErrorCode.MALFORMED_FRAME,
                "sender identity is not an actor name (set ZMQ_IDENTITY to your name)",
            )
            return
        if self._route.get(sender) != rid:
            if len(self._route) >= _NAME_CACHE_MAX and sender not in self._route:
                self._route.clear()
            self._route[sender] = rid
        if user is not None and user != _OPERATOR and len(rid) == 5 and rid[:1] == b"\0":
            if len(self._known) >= _NAME_CACHE_MAX:
                self._known.clear()
            self._known[rid] = sender
        if self._peers.touch(sender, now):
            self._registered(sender)
        if len(body) > self._max_body:
            self._refuse(
                rid,
                body,
                protocol.ErrorCode.FRAME_TOO_LARGE,
                f"{len(body)} bytes > limit {self._max_body}",
            )
        elif to == BROKER_NAME:
            self._control_frame(sender, body, rid)
        elif self._hook is not None and to not in self._route and \
                self._to_hook(sender, to, body, rid):
            return  # the route hook's (broker/hooks.py), or refused by it
        elif not self._valid_name(to):
            self._refuse(
                rid,
                body,
                protocol.ErrorCode.MALFORMED_FRAME,
                f"recipient {to[:80]!r} is not an actor name",
            )
        else:
            dest = self._route.get(to)
            if dest is None:  # never registered: as unreachable as a gone peer
                self._route_failed(sender, to, body, zmq.ZMQError(zmq.EHOSTUNREACH), rid)
                return
            try:
                self._sock.send_multipart([dest, sender, body], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._route_failed(sender, to, body, exc, rid)
            else:
                self._routed += 1

    def _valid_name(self, name: bytes) -> bool:
        if name in self._names:
            return True
        try:
            text = name.decode("ascii")
        except UnicodeDecodeError:
            return False
        if name == BROKER_NAME or not NAME_PATTERN.fullmatch(text):
            return False
        if len(self._names) >= _NAME_CACHE_MAX:
            self._names.clear()
        self._names.add(name)
        return True

    def _valid_sender(self, name: bytes) -> bool:
        return self._valid_name(name)

    def _register(self, sender: bytes) -> None:
        self._peers.touch(sender, time.monotonic())
        self._registered(sender)

    def _registered(self, sender: bytes) -> None:
        log.info("peer_registered", peer=sender.decode("ascii", "replace"), peers=len(self._peers))
        self._send_heartbeat(sender, self._heartbeat_frame())

    def _route_failed(self, sender: bytes, to: bytes, body: bytes, exc: zmq.ZMQError,
                      rid: bytes) -> None:
        if exc.errno == zmq.EHOSTUNREACH:
            self._unknown += 1
            code = protocol.ErrorCode.UNKNOWN_RECIPIENT
            detail = f"no peer named {to.decode('ascii', 'replace')!r} is connected"
        elif exc.errno == zmq.EAGAIN:
            self._busy += 1
            code = protocol.ErrorCode.RECIPIENT_BUSY
            detail = f"the queue to {to.decode('ascii', 'replace')!r} is full; retry later"
        else:
            code = protocol.ErrorCode.INTERNAL_ERROR
            detail = f"routing to {to.decode('ascii', 'replace')!r} failed: {exc}"
        peeked = protocol.peek(body, self.limits)
        if self._limiter.allow():
            log.warning(
                "route_failed",
                sender=sender.decode("ascii", "replace"),
                recipient=to.decode("ascii", "replace"),
                code=code.value,
                errno=exc.errno,
                msg_id=peeked.msg_id,
                kind=peeked.kind,
            )
        self._reply_error(rid, peeked, code, detail)

    def _refuse(self, sender: bytes, body: bytes, code: protocol.ErrorCode, detail: str) -> None:
        self._rejected += 1
        peeked = protocol.peek(body, self.limits)
        if self._limiter.allow():
            log.warning(
                "frame_rejected",
                sender=sender[:80].decode("ascii", "replace"),
                code=code.value,
                detail=detail,
                msg_id=peeked.msg_id,
                kind=peeked.kind,
            )
        self._reply_error(sender, peeked, code, detail)

    def _reply_error(
        self, sender: bytes, peeked: protocol.Peeked, code: protocol.ErrorCode, detail: str
    ) -> None:
        if peeked.is_reply:
            self._unanswered += 1  # never answer an error (or any reply) with an error
            return
        frame = protocol.error_frame(ProtocolError(code.value, detail), peeked.msg_id)
        self._errors += 1
        try:
            self._sock.send_multipart([sender, BROKER_NAME, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            # the sender is gone or not reading: nobody is left to tell
            self._unanswered += 1

    # --- control messages addressed to the broker ----------------------------
    def _control_frame(self, sender: bytes, body: bytes, rid: bytes) -> None:
        self._control += 1
        try:
            message = protocol.decode(body, self.limits)
        except ProtocolError as exc:
            self._rejected += 1
            if self._limiter.allow():
                log.warning(
                    "frame_rejected",
                    sender=sender[:80].decode("ascii", "replace"),
                    code=exc.code,
                    detail=exc.detail[:200],
                    msg_id=exc.msg_id,
                )
            self._reply_error(
                rid,
                protocol.peek(body, self.limits) if exc.msg_id is None else
                protocol.Peeked(None, exc.msg_id),
                protocol.ErrorCode(exc.code),
                exc.detail,
            )
            return
        if protocol.is_reply(message) and not isinstance(message, protocol.Heartbeat):
            self._unanswered += 1  # an unsolicited reply (an error above all): never answered
            return
        reply: protocol.Pong | protocol.Stats | None
        match message:
            case protocol.Heartbeat(values=values):
                reply = None  # liveness was recorded on arrival
                if values.get("idle") == 1:  # an idle actor: quiet until it speaks
                    self._peers.hush(sender)
            case protocol.Ping(msg_id=msg_id):
                reply = protocol.Pong(msg_id=msg_id, actor="broker", pid=self._pid)
            case protocol.StatsRequest(msg_id=msg_id):
                reply = protocol.Stats(msg_id=msg_id, actor="broker", values=self.values())
            case _:
                self._rejected += 1
                if self._limiter.allow():
                    log.warning(
                        "frame_rejected",
                        sender=sender[:80].decode("ascii", "replace"),
                        code=protocol.ErrorCode.UNEXPECTED_MESSAGE.value,
                        detail=f"the broker does not serve {message.kind!r}",
                        msg_id=getattr(message, "msg_id", None),
                    )
                self._reply_error(
                    rid,
                    protocol.Peeked(message.kind, getattr(message, "msg_id", None)),
                    protocol.ErrorCode.UNEXPECTED_MESSAGE,
                    f"the broker does not serve {message.kind!r}",
                )
                return
        if reply is not None:
            frame = protocol.encode(reply)
            with contextlib.suppress(zmq.ZMQError):  # gone or not reading: it will ask again
                self._sock.send_multipart([rid, BROKER_NAME, frame], zmq.NOBLOCK)

    # --- heartbeats and expiry -------------------------------------------------
    def _heartbeat_frame(self) -> bytes:
        return protocol.encode(
            protocol.Heartbeat(actor="broker", pid=self._pid, values={"peers": len(self._peers)})
        )

    def _send_heartbeat(self, peer: bytes, frame: bytes) -> None:
        rid = self._route.get(peer, peer)
        try:
            self._sock.send_multipart([rid, BROKER_NAME, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._known.pop(rid, None)  # that connection is gone: never trust its id again
                self._parking.forget(rid)
                if self._route.get(peer) == rid:  # the next connection's first frame: slow path
                    del self._route[peer]
                if self._peers.forget(peer):
                    log.info("peer_disconnected", peer=peer.decode("ascii", "replace"))

    def _housekeep(self, now: float) -> None:
        self._limiter.tick()
        for peer, silent_s in self._peers.expire(now):
            self._expired += 1
            log.info(
                "peer_expired",
                peer=peer.decode("ascii", "replace"),
                silent_s=round(silent_s, 3),
                misses=self.rule.misses,
            )
        frame = self._heartbeat_frame()
        for peer in self._peers.names():
            self._send_heartbeat(peer, frame)
        if now >= self._quiet_probe_at:
            self._quiet_probe_at = now + self._quiet_probe_s
            for peer in list(self._peers.quiet):
                self._send_heartbeat(peer, frame)
        parked = self._parking.due(now)
        if parked:
            self._renew(now, parked)

    # --- parked connections (broker/parking.py) --------------------------------
    def _handshakes(self) -> None:
        """Count the handshakes the monitor reported since the last turn."""
        monitor = self._monitor
        now = time.monotonic()
        while monitor.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[arg-type,operator]
            monitor.recv_multipart(_NOBLOCK)
            self._parking.handshake(now)

    def _renew(self, now: float, parked: int) -> None:
        """Close the ROUTER (and every connection, the parked ones with it) and
        bind a new one: peers reconnect and register again, as after a restart."""
        counts = self._parking.values()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._route.clear()
        self._known.clear()
        self._sock, self._monitor = self._open_socket(list(self.bound), deadline_s=2.0)
        self._parking.renewed(now, parked)
        log.warning("socket_renewed", parked=parked, renewals_total=self._parking.renewals_total,
                    **counts)

    # --- the route hook: names with no local route (broker/hooks.py) ----------
    def _to_hook(self, sender: bytes, to: bytes, body: bytes, rid: bytes) -> bool:
        """Route `to` (no local route) through the hook; False: not the hook's."""
        assert self._hook is not None
        routed = self._hook.route(sender, to, body)
        if routed is None:
            return False
        if isinstance(routed, hooks.Local):
            failed = self._send_local(routed.name, sender, body)
            if failed is not None:
                self._route_failed(sender, routed.name, body, failed, rid)
        elif isinstance(routed, hooks.Refusal):
            peeked = protocol.peek(body, self.limits)
            if self._limiter.allow():
                log.warning("route_failed", sender=sender.decode("ascii", "replace"),
                            recipient=to[:140].decode("ascii", "replace"),
                            code=routed.code.value, detail=routed.detail,
                            msg_id=peeked.msg_id, kind=peeked.kind)
            self._reply_error(rid, peeked, routed.code, routed.detail)
        else:
            self._routed += 1
        return True

    def _send_local(self, to: bytes, sender: bytes, body: bytes) -> zmq.ZMQError | None:
        """Route to the local peer `to`; the error when it is not there or busy."""
        dest = self._route.get(to)
        if dest is None:
            return zmq.ZMQError(zmq.EHOSTUNREACH)
        try:
            self._sock.send_multipart([dest, sender, body], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return exc
        self._routed += 1
        return None

    def _from_hook(self) -> None:
        """Deliver the frames the route hook received, `[to, sender, body]`; one
        it cannot deliver goes back to the hook (which answers its sender)."""
        assert self._hook is not None
        inbox = self._hook.inbox
        for _ in range(DRAIN_BATCH):
            if not inbox.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[arg-type,operator]
                return
            frames = inbox.recv_multipart(_NOBLOCK)
            if len(frames) != 3:
                continue
            to, sender, body = frames
            exc = self._send_local(to, sender, body)
            if exc is not None:
                self._hook.undeliverable(to, sender, body, protocol.ErrorCode.RECIPIENT_BUSY
                                         if exc.errno == zmq.EAGAIN
                                         else protocol.ErrorCode.UNKNOWN_RECIPIENT)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.close()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[ModuleType]]:
    parser = argparse.ArgumentParser(prog="python -m broker.server", description=__doc__)
    skeleton.add_arguments(parser, binds=True, hooks=True)
    parser.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    parser.add_argument("--heartbeat-misses", type=int, default=3)
    parser.add_argument(
        "--max-frame-bytes", type=int, default=protocol.DEFAULT_LIMITS.max_frame_bytes
    )
    parser.add_argument("--quiet-probe-s", type=float, default=QUIET_PROBE_S,
                        help="how often a quiet (idle) peer gets a heartbeat (tests)")
    parser.add_argument("--renew-interval-s", type=float, default=MIN_INTERVAL_S,
                        help="renew the socket to free parked connections at most this often")
    return skeleton.parse_args(parser, argv, hooks=True)  # with the hooks' options


def _route_hook(modules: list[ModuleType], ctx: zmq.Context[zmq.Socket[bytes]],
                args: argparse.Namespace, state: StateDir,
                limits: protocol.Limits) -> hooks.RouteHook | None:
    """The route hook the `--hook` modules make (at most one; None: none)."""
    made = [hook for f in hooks.factories(modules, "route_hook")
            if (hook := f(ctx, args, state, limits)) is not None]
    if len(made) > 1:
        raise ConfigError(f"{len(made)} route hooks: the broker takes one")
    return made[0] if made else None


# How a failure ends the broker: the first entry that matches (LockHeldError
# is a StateDirError); none is logged (the lock is taken before the log opens).
EXITS = (
    skeleton.Exit(LockHeldError, EXIT_LOCKED,
                  says="{exc}: another broker serves this state directory"),
    skeleton.Exit((ConfigError, StateDirError, auth.AuthError), EXIT_CONFIG),
)


def main(argv: list[str] | None = None) -> int:
    proc = skeleton.Process("broker", EXITS)
    return proc.run(lambda: _run(proc, argv))


def _run(proc: skeleton.Process, argv: list[str] | None) -> int:
    args, modules = _parse(argv)
    state = proc.state_dir(args.state_dir)
    endpoint = state.endpoint("broker")
    lock = PidLock(state.run_dir / "broker.lock")
    lock.acquire()  # one broker per state directory: a second would steal the socket path
    proc.on_close(lock.release)
    proc.configure_logging(state, args)
    raise_fd_limit()  # a connection an actor (broker/fdlimit.py)
    rule = HeartbeatRule(args.heartbeat_interval_ms / 1000.0, args.heartbeat_misses)
    limits = protocol.Limits(max_frame_bytes=args.max_frame_bytes)
    ctx = proc.context()
    server = curve.load_server(curve.keys_dir(state.root)) if args.curve else None
    zap = auth.ZapHandler(ctx, auth.ensure_keys(state),
                          server.authorized_dir if server is not None else None)
    proc.on_close(zap.close)
    broker = Broker(
        ctx, endpoint, rule, limits, curve_server=server, tcp_endpoints=tuple(args.tcp),
        zap=zap, renew_interval_s=args.renew_interval_s, quiet_probe_s=args.quiet_probe_s,
        route_hook=_route_hook(modules, ctx, args, state, limits),
    )
    proc.on_close(lambda: log.info("broker_stopped", **broker.statistics().values()))
    proc.on_close(broker.close)
    write_atomic(state.run_dir / "broker.endpoints", ("\n".join(broker.bound) + "\n").encode())
    proc.stop_on_signals(broker.stop)
    reporter = ControlReporter.from_env(ctx, "broker")
    if reporter is not None:
        proc.on_close(reporter.close)
    log.info(
        "broker_started",
        endpoint=endpoint,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_misses=args.heartbeat_misses,
        max_frame_bytes=args.max_frame_bytes,
    )
    if reporter is not None:
        reporter.ready()
    broker.run(reporter)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
