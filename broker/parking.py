"""Connections ZeroMQ parks at the broker's ROUTER, and when to renew the socket.

libzmq 4.3.5's ROUTER (ROUTER_HANDOVER off, as the broker must keep it: with
it on, a peer claiming another's routing id takes over its traffic) parks a
connection whose peer claims a ZMQ identity already in use: it never reads
it, never tells the application, and never frees it, even after the peer has
gone (the parked queue of up to RCVHWM frames, ~20 KB at the least, and the
connection's fd once that queue is full). ZMTP heartbeats would close it but
abort libzmq (`out_event` asserts on the engine a gone peer stalled), and
ROUTER_NOTIFY is a draft option the released library leaves out. Closing the
socket is the one thing that frees a parked connection.

So the broker counts: every handshake that succeeded (its socket monitor)
against every connection that ever delivered a frame (a routing id first seen
by the slow path; each connection's first frame takes it). A handshake older
than GRACE_S that no frame ever followed is a parked connection (or a client
that connects and never speaks, which corral's clients never do: a peer
registers with a heartbeat at once). `Parking.due` says when the broker
should renew its ROUTER: parked connections exist and the last renewal is
MIN_INTERVAL_S ago. Renewing drops every connection; peers reconnect within
ZeroMQ's reconnect interval and resend what went unanswered, as after a broker
restart. docs/broker.md, "Parked connections"."""

from __future__ import annotations

from collections import deque

GRACE_S = 5.0  # a connection has this long after its handshake to send its first frame
MIN_INTERVAL_S = 10.0  # renewals at most this often: a spoofer cannot keep the broker resetting
_SEEN_MAX = 1 << 16  # routing ids remembered; beyond, start over from the current estimate


class Parking:
    """The estimate of parked connections since the socket was (re)opened."""

    def __init__(self, now: float, *, grace_s: float = GRACE_S,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.grace_s = grace_s
        self.min_interval_s = min_interval_s
        self.renewals_total = 0
        self.parked_total = 0  # parked connections freed by renewals
        self._last_renewal = now
        self.reset(now)

    def reset(self, now: float) -> None:
        """A new socket: nothing handshaken, nothing seen."""
        self._handshakes: deque[float] = deque()  # times of handshakes not yet matched
        self._seen: set[bytes] = set()
        self._unmatched_seen = 0  # first frames not yet matched against a handshake
        self._opened = now

    def handshake(self, now: float) -> None:
        """The monitor reported one succeeded handshake."""
        if self._unmatched_seen:
            self._unmatched_seen -= 1  # its first frame was read before the event
        else:
            self._handshakes.append(now)

    def seen(self, rid: bytes) -> None:
        """A frame from routing id `rid` (called for every frame the slow path takes)."""
        if rid in self._seen:
            return
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        self._seen.add(rid)
        if self._handshakes:
            self._handshakes.popleft()
        else:
            self._unmatched_seen += 1

    def values(self) -> dict[str, int]:
        """For the log line of a renewal: handshakes no frame followed yet (old
        or young), connections seen since the socket was opened."""
        return {"unanswered_handshakes": len(self._handshakes), "seen": len(self._seen)}

    def forget(self, rid: bytes) -> None:
        """`rid`'s connection is gone: a connection claiming it again is a new one."""
        self._seen.discard(rid)

    def parked(self, now: float) -> int:
        """Handshakes older than the grace that no first frame followed."""
        count = 0
        for at in self._handshakes:
            if now - at < self.grace_s:
                break
            count += 1
        return count

    def due(self, now: float) -> int:
        """The parked connections a renewal now would free; 0: not due."""
        if now - self._last_renewal < self.min_interval_s:
            return 0
        return self.parked(now)

    def renewed(self, now: float, freed: int) -> None:
        self.renewals_total += 1
        self.parked_total += freed
        self._last_renewal = now
        self.reset(now)
