"""The writer's replication to NATS JetStream in fleet mode.

See docs/fleet.md ("The fleet ack rule", "Fencing").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog

from actors.writer.hooks import EXIT_HALTED, HaltedError
from actors.writer.wal import WalRecord, iter_segment, list_segments
from broker.errors import DurabilityError
from broker.statedir import StateDir
from supervisor.fleet.natsclient import (
    FleetSettings,
    add_fleet_arguments,
    connect_options,
    settings_from_args,
)

WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for a failed Nats-Expected-Last-Sequence
STREAM_IN_USE = 10058  # a stream of that name exists (with another configuration)
DUPLICATE_WINDOW_S = 120.0
EXIT_FENCED = EXIT_HALTED


class FencedError(HaltedError):
    """The host's stream carries a fence: another host adopted this host's agents."""


class ReplicationStoppedError(DurabilityError):
    """The writer stopped while a batch still waited for the stream (not acknowledged)."""


def stream_name(host: str) -> str:
    return f"CORRAL_WAL_{host}"


def batch_subject(host: str) -> str:
    return f"corral.wal.{host}.batch"


def fence_subject(host: str) -> str:
    return f"corral.wal.{host}.fence"


def parse_seq_range(value: str) -> tuple[int, int]:
    first, _, last = value.partition("-")
    return int(first), int(last)


def local_records(wal_dir: Path, after: int, through: int) -> Iterator[WalRecord]:
    """The local WAL's records after seq `after` up to `through`, in order."""
    segments = list_segments(wal_dir)
    for i, (first, path) in enumerate(segments):
        nxt = segments[i + 1][0] if i + 1 < len(segments) else None
        if nxt is not None and nxt <= after + 1:
            continue
        for _offset, record in iter_segment(path):
            if not isinstance(record, WalRecord):
                return
            if record.seq > through:
                return
            if record.seq > after:
                yield record
        del first


class Replicator:
    """Publishes durable batches to the host's stream; see the module docstring."""

    def __init__(self, settings: FleetSettings, wal_dir: Path) -> None:
        self.settings = settings
        self.wal_dir = wal_dir
        self.log: structlog.stdlib.BoundLogger = structlog.get_logger("writer.fleet")
        self.stream = stream_name(settings.host)
        self.subject = batch_subject(settings.host)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-nats",
                                        daemon=True)
        self._nc: Any = None
        self._js: Any = None
        self._closing = False
        self._max_payload = 1024 * 1024
        # the stream's position (None: unknown, read it before publishing)
        self.stream_last: int | None = None
        self.replicated_seq: int | None = None  # the last WAL seq in the stream
        self.confirmed_seq = 0  # the last WAL seq known in the stream (for status)
        self.connected = False
        self.fenced = False
        # the batch being replicated was handed over then (None: none is)
        self.waiting_since: float | None = None
        self.published_total = 0
        self.retries_total = 0
        self._outage_logged = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, wal_dir: Path) -> Replicator | None:
        settings = settings_from_args(args)
        return None if settings is None else cls(settings, wal_dir)

    # --- lifecycle (any thread) ---------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stopping(self, grace_s: float = 0.0) -> None:
        """Stop retrying after `grace_s` (a waiting batch then fails unacknowledged)."""
        def stop() -> None:
            self._closing = True
        if grace_s > 0:
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, stop)
        else:
            self._closing = True

    def close(self) -> None:
        self._closing = True
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._disconnect(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def values(self) -> dict[str, int | float]:
        waiting = self.waiting_since
        return {
            "fleet_connected": int(self.connected),
            "fleet_fenced": int(self.fenced),
            "fleet_replicated_seq": self.confirmed_seq,
            "fleet_waiting_s": round(time.monotonic() - waiting, 3) if waiting else 0.0,
            "fleet_published_total": self.published_total,
            "fleet_retries_total": self.retries_total,
        }

    # --- the hook (the sync worker's thread) ---------------------------------
    def after_durable(self, first: int, lines: list[bytes]) -> None:
        """Block until records first..first+len(lines)-1 (and every one before
        them) are in the stream. Raises FencedError, ReplicationStoppedError."""
        self.waiting_since = time.monotonic()
        future: Future[None] = asyncio.run_coroutine_threadsafe(
            self._replicate(first, lines), self._loop)
        try:
            future.result()
        finally:
            self.waiting_since = None

    # --- on the event loop ----------------------------------------------------
    async def _disconnect(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def _connect(self) -> Any:
        if self._nc is not None and self._nc.is_connected:
            return self._js
        if self._nc is None:
            import nats  # noqa: PLC0415 - the fleet extra, only in fleet mode

            async def quiet(exc: Exception) -> None:  # errors are counted, not printed
                self.connected = False

            self._nc = await nats.connect(
                **connect_options(self.settings, f"corral-writer-{self.settings.host}"),
                error_cb=quiet, disconnected_cb=self._on_disconnect)
            self._js = self._nc.jetstream(timeout=self.settings.publish_timeout_s)
            self._max_payload = int(self._nc.max_payload) - 4096
            await self._ensure_stream()
        if not self._nc.is_connected:
            raise ConnectionError("reconnecting")
        return self._js

    async def _on_disconnect(self) -> None:
        self.connected = False

    async def _ensure_stream(self) -> None:
        from nats.js.api import StorageType, StreamConfig  # noqa: PLC0415
        from nats.js.errors import APIError  # noqa: PLC0415

        config = StreamConfig(
            name=self.stream,
            subjects=[f"corral.wal.{self.settings.host}.>"],
            num_replicas=self.settings.replicas,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
        )
        try:
            await self._js.add_stream(config)
        except APIError as exc:
            if exc.err_code != STREAM_IN_USE:
                raise
            await self._js.stream_info(self.stream)  # it exists: use it as it is

    async def _load_position(self) -> None:
        info = await self._js.stream_info(self.stream)
        last = int(info.state.last_seq)
        if last == 0:
            self.stream_last, self.replicated_seq = 0, 0
            return
        msg = await self._js.get_msg(self.stream, last)
        headers = msg.headers or {}
        if "Corral-Fence" in headers:
            self.fenced = True
            raise FencedError(f"host {self.settings.host} is fenced: "
                              f"{headers['Corral-Fence']}")
        self.stream_last = last
        self.replicated_seq = parse_seq_range(headers["Corral-Seq"])[1]
        self.confirmed_seq = self.replicated_seq

    async def _replicate(self, first: int, lines: list[bytes]) -> None:
        from nats.js.errors import APIError  # noqa: PLC0415

        delay = 0.05
        while True:
            if self._closing:
                raise ReplicationStoppedError(
                    f"stopped with seq {first}-{first + len(lines) - 1} not yet in the stream")
            try:
                await self._attempt(first, lines)
            except DurabilityError:
                raise
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    self.replicated_seq = None  # another message came first: re-read
                    continue
                self._unavailable(first, f"api error {exc.err_code}")
            except Exception as exc:  # noqa: BLE001 - unreachable, timed out: retry in order
                self._unavailable(first, type(exc).__name__)
            else:
                self.connected = True
                if self._outage_logged:
                    self.log.info("fleet_replication_resumed", replicated_seq=self.replicated_seq)
                    self._outage_logged = False
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _attempt(self, first: int, lines: list[bytes]) -> None:
        last = first + len(lines) - 1
        await self._connect()
        if self.replicated_seq is None:
            await self._load_position()
        assert self.replicated_seq is not None
        if self.replicated_seq > last:  # records this WAL never published
            raise DurabilityError(
                f"stream {self.stream} holds seq up to {self.replicated_seq}, beyond "
                f"this WAL's {last}: it belongs to another WAL (docs/fleet.md)")
        if self.replicated_seq < first - 1:  # the stream lacks older records
            await self._publish_local(first - 1)
        done = self.replicated_seq
        if done < last:
            await self._publish(first, lines[done + 1 - first:])

    def _unavailable(self, first: int, reason: str) -> None:
        self.connected = False
        self.replicated_seq = None  # a timed-out publish may still commit: re-read
        self.retries_total += 1
        if not self._outage_logged:
            self._outage_logged = True
            self.log.warning("fleet_replication_waiting", first_seq=first, reason=reason,
                             stream=self.stream)

    async def _publish_local(self, through: int) -> None:
        """Publish the local WAL's records the stream lacks, up to `through`."""
        assert self.replicated_seq is not None
        chunk: list[bytes] = []
        chunk_first = self.replicated_seq + 1
        size = 0
        for record in local_records(self.wal_dir, self.replicated_seq, through):
            if chunk and size + len(record.line) > self._max_payload:
                await self._publish(chunk_first, chunk)
                chunk, size, chunk_first = [], 0, record.seq
            chunk.append(record.line)
            size += len(record.line)
        if chunk:
            await self._publish(chunk_first, chunk)
        if self.replicated_seq < through:
            raise DurabilityError(f"the local WAL lacks seq {self.replicated_seq + 1}-{through}")

    async def _publish(self, first: int, lines: list[bytes]) -> None:
        """Publish records first.. as messages of at most max payload, in order."""
        start = 0
        while start < len(lines):
            end, size = start, 0
            while end < len(lines) and (end == start or size + len(lines[end])
                                        <= self._max_payload):
                size += len(lines[end])
                end += 1
            a, b = first + start, first + end - 1
            ack = await self._js.publish(
                self.subject, b"".join(lines[start:end]),
                headers={"Nats-Msg-Id": f"{self.settings.host}:{a}-{b}",
                         "Nats-Expected-Last-Sequence": str(self.stream_last),
                         "Corral-Seq": f"{a}-{b}"})
            if ack.duplicate:  # an earlier attempt committed: re-read to be exact
                self.replicated_seq = None
                await self._load_position()
                assert self.replicated_seq is not None
                if self.replicated_seq < b:
                    raise DurabilityError(f"duplicate ack for {a}-{b} but the stream ends "
                                          f"at {self.replicated_seq}")
            else:
                self.stream_last, self.replicated_seq = int(ack.seq), b
            self.confirmed_seq = self.replicated_seq
            self.published_total += 1
            start = end


# --- the writer's hook (actors/writer/hooks.py): `--hook supervisor.fleet.replicate` --
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fleet_arguments(parser)


def writer_hook(args: argparse.Namespace, state_dir: StateDir) -> Replicator | None:
    """The replicator with `--fleet-host`, else None. Raises ConfigError."""
    return Replicator.from_args(args, state_dir.wal_dir)
