"""The heartbeat rule of the message plane, as pure decisions over timestamps.

See docs/broker.md ("Heartbeats").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HeartbeatRule:
    """Interval and allowed misses, shared by the broker and its peers."""

    interval_s: float = 1.0
    misses: int = 3

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {self.interval_s}")
        if self.misses < 1:
            raise ValueError(f"heartbeat misses must be >= 1, got {self.misses}")

    @property
    def expiry_s(self) -> float:
        """Silence after which the other side is dead."""
        return self.interval_s * self.misses


@dataclass
class PeerTable:
    """The broker's view of its peers: identity -> last time a frame came in.
    A quiet peer (an idle actor, `BrokerPeer.hush`) is neither sent
    heartbeats nor expired until it sends anything else."""

    rule: HeartbeatRule
    last_seen: dict[bytes, float] = field(default_factory=dict)
    quiet: set[bytes] = field(default_factory=set)

    def touch(self, name: bytes, now: float) -> bool:
        """Record a sign of life; True when `name` was not known before."""
        new = name not in self.last_seen
        self.last_seen[name] = now
        if self.quiet:
            self.quiet.discard(name)
        return new

    def hush(self, name: bytes) -> None:
        """`name` said it is idle: no beats to it, no expiry, until it speaks."""
        if name in self.last_seen:
            self.quiet.add(name)

    def forget(self, name: bytes) -> bool:
        """Drop a peer (it disconnected); True if it was known."""
        self.quiet.discard(name)
        return self.last_seen.pop(name, None) is not None

    def expire(self, now: float) -> list[tuple[bytes, float]]:
        """Remove and return the peers silent longer than the expiry, with
        their silence (a quiet peer is never expired)."""
        limit = self.rule.expiry_s
        dead = [(name, now - seen) for name, seen in self.last_seen.items()
                if now - seen > limit and name not in self.quiet]
        for name, _ in dead:
            del self.last_seen[name]
        return dead

    def __len__(self) -> int:
        return len(self.last_seen)

    def names(self) -> list[bytes]:
        """The peers owed a heartbeat (the quiet ones are not)."""
        if not self.quiet:
            return list(self.last_seen)
        return [name for name in self.last_seen if name not in self.quiet]


@dataclass
class Liveness:
    """One side's view of the other: when to beat next, and whether it is dead."""

    rule: HeartbeatRule
    last_heard: float
    next_beat: float = 0.0

    def heard(self, now: float) -> None:
        self.last_heard = now

    def beat_due(self, now: float) -> bool:
        """True (and schedule the next one) when a heartbeat should go out now."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.rule.interval_s
        return True

    def dead(self, now: float) -> bool:
        return now - self.last_heard > self.rule.expiry_s

    def next_deadline(self) -> float:
        """The earliest time something must happen (a beat, or the expiry check)."""
        return min(self.next_beat, self.last_heard + self.rule.expiry_s)

    def reset(self, now: float) -> None:
        """After a reconnect: a full expiry window again, and beat at once."""
        self.last_heard = now
        self.next_beat = now
