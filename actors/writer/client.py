"""The client side of the writer: keyed appends (retried until answered), reads.

Talks to the writer directly, on the local lane when it can, else on the
ROUTER. See docs/protocol.md ("The writer (`run/writer.sock`)",
"The local lane (`run/writer.lane`)").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import zmq

from actors.writer.lane import lane_path
from actors.writer.laneclient import LaneClient, lane_enabled
from actors.writer.wal import WalRecord, parse_record
from broker import appendwire, auth, compactjson, protocol
from broker.curve import CurveClient
from broker.errors import ProtocolError, RemoteError
from broker.requester import Requester, new_msg_id
from broker.statedir import StateDir

# Soak and test instrumentation: when set, every acknowledged append is also
# journaled, fsynced, to <dir>/<origin>.acks as "key<TAB>seq<TAB>unix time"
# lines, an independent record outside .corral/ of what the writer acknowledged.
ENV_ACK_JOURNAL_DIR = "CORRAL_ACK_JOURNAL_DIR"


class AckJournal:
    """Append-only, fsynced file of acknowledged (key, seq) for one origin."""

    def __init__(self, directory: Path, origin: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / (origin.replace("/", "%") + ".acks")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def record(self, key: str, seq: int) -> None:
        os.write(self._fd, f"{key}\t{seq}\t{time.time():.6f}\n".encode())
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _kind(reply: object) -> str:
    return str(getattr(reply, "kind", type(reply).__name__))


_LONG_DIGITS = re.compile(rb"[0-9]{19}")  # i64 and u64 need 19 and 20 digits at most


def encode_payload(value: Any) -> bytes:
    """Compact JSON, the form the WAL stores: json's bytes and refusals, on
    orjson (broker/compactjson.py)."""
    return compactjson.dumps(value)


def decode_payload(body: bytes) -> Any:
    """The value of a payload `encode_payload` made, as json reads it back,
    for the fold: orjson, a few times faster, except where it differs from
    json. It reads an integer past 64 bits as a float (json keeps it an int),
    so a body holding a run of 19 digits (anywhere, strings included) is read
    by json; so is one orjson declines."""
    if _LONG_DIGITS.search(body) is None:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


class WriterClient:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        state_dir: StateDir,
        origin: str,
        *,
        timeout_s: float = 2.0,
        retries: int = 10,
        endpoint: str | None = None,
        curve: CurveClient | None = None,
        credential: auth.Credential | None = None,
        storage_wait_s: float = 300.0,
    ) -> None:
        """`endpoint` defaults to the state directory's ipc socket; a tcp://
        endpoint of a writer on another host needs `curve` keys. `credential`
        defaults to this process's own (broker/auth.py `process_credential`).
        Appends go on the local lane unless an `endpoint` or `curve` is given
        or CORRAL_WRITER_LANE=0."""
        self.origin = origin
        self.timeout_s = timeout_s
        self.retries = retries
        self.storage_wait_s = storage_wait_s
        # called after each `storage_full` refusal while the append waits: an
        # agent's watchdog is touched, so its heartbeats go on (docs/storage.md)
        self.storage_waiting: Callable[[], None] | None = None
        router = endpoint or state_dir.endpoint("writer")
        self._req = Requester(ctx, router, curve=curve, credential=credential)
        self._lane: LaneClient | None = None
        if endpoint is None and curve is None and lane_enabled():
            lane_credential = credential or auth.default_credential(router)
            if lane_credential is not None:
                self._lane = LaneClient(lane_path(state_dir.run_dir), lane_credential)
        journal_dir = os.environ.get(ENV_ACK_JOURNAL_DIR)
        self._journal_dir = Path(journal_dir) if journal_dir else None
        self._journals: dict[str, AckJournal] = {}

    @property
    def reconnects(self) -> int:
        return self._req.reconnects

    def append(
        self,
        stream: str,
        event: str,
        payload: bytes | Any,
        *,
        key: str,
        ledger: protocol.LedgerName | None = None,
        origin: str | None = None,
    ) -> appendwire.AppendOkFrame:
        """Durably append one event; returns its ack (`seq`, `duplicate`) once
        it is on disk. `origin` (default: the client's) names the idempotency
        window of `key`: an actor appending for many sessions gives each its
        own window.

        The ack is the frame decoded in C (no model is built for it: that
        was a fifth of the appender's Python; docs/decisions.md, "The
        append path's frames in msgspec"); while the writer answers `storage_full` (a full
        disk, docs/storage.md) the append is sent again under the same key,
        backing off, for up to `storage_wait_s`, then the RemoteError raised."""
        body = payload if isinstance(payload, bytes) else encode_payload(payload)
        origin = origin or self.origin
        the_origin = origin

        def encode(msg_id: str) -> bytes:
            frame = appendwire.encode_append(msg_id=msg_id, origin=the_origin, key=key,
                                             stream=stream, event=event, payload=body,
                                             ledger=ledger)
            if frame is None:  # a field is not valid: the model says which (ValidationError)
                frame = protocol.encode(protocol.Append(msg_id=msg_id, origin=the_origin,
                                                        key=key, stream=stream, event=event,
                                                        payload=body, ledger=ledger))
            return frame

        answer = self._send_until_stored(encode, "a", "append")
        if type(answer) is appendwire.AppendOkFrame:  # the ack, decoded in C
            reply = answer
        elif isinstance(answer, protocol.AppendOk):  # what appendwire could not vouch for
            reply = appendwire.AppendOkFrame(msg_id=answer.msg_id, seq=answer.seq,
                                             duplicate=answer.duplicate, v=1)
        else:
            raise ProtocolError("unexpected_message", f"append answered with {_kind(answer)}")
        if self._journal_dir is not None:
            self._journal(origin).record(key, reply.seq)
        return reply

    def _journal(self, origin: str) -> AckJournal:
        assert self._journal_dir is not None
        journal = self._journals.get(origin)
        if journal is None:
            journal = self._journals[origin] = AckJournal(self._journal_dir, origin)
        return journal

    def _send_until_stored(
        self, encode: Callable[[str], bytes], prefix: str, kind: str,
    ) -> protocol.Message | appendwire.AppendOkFrame | appendwire.AppendManyOkFrame:
        """The answer to the append `encode(msg_id)` makes, sent again under
        its keys while the writer's disk is full (`_storage_full_wait`)."""
        deadline = time.monotonic() + self.storage_wait_s
        backoff_s = 0.05
        lane = self._lane
        while True:
            msg_id = new_msg_id(prefix)
            try:
                frame = encode(msg_id)
                if lane is not None:
                    answer = lane.request_append(frame, msg_id, timeout_s=self.timeout_s)
                    if answer is not None:
                        return answer
                return self._req.request_append(frame, msg_id, kind,
                                                timeout_s=self.timeout_s, retries=self.retries)
            except RemoteError as exc:
                backoff_s = self._storage_full_wait(exc, deadline, backoff_s)
                if self.storage_waiting is not None:
                    self.storage_waiting()

    @staticmethod
    def _storage_full_wait(exc: RemoteError, deadline: float, backoff_s: float) -> float:
        """After a refused append: raise `exc` unless the writer's disk is full and
        `deadline` is ahead; else wait `backoff_s` and return the next backoff."""
        if exc.code != protocol.ErrorCode.STORAGE_FULL or time.monotonic() >= deadline:
            raise exc
        time.sleep(backoff_s)
        return min(backoff_s * 2, 1.0)

    def append_many(
        self,
        stream: str,
        records: list[tuple[str, bytes, str, protocol.LedgerName | None]],
        *,
        origin: str | None = None,
    ) -> appendwire.AppendManyOkFrame:
        """Durably append `records` (event, payload, key, ledger) of one stream
        at once: one round trip, one fdatasync, consecutive seqs from the
        reply's `seq`, all or none of them after a crash. Retried under the
        same keys until answered, like `append`; its ack is the frame decoded
        in C, as `append`'s."""
        origin = origin or self.origin
        the_origin = origin

        def encode(msg_id: str) -> bytes:
            frame = appendwire.encode_append_many(msg_id=msg_id, origin=the_origin,
                                                  stream=stream, records=records)
            if frame is None:
                frame = protocol.encode(protocol.AppendMany(
                    msg_id=msg_id, origin=the_origin, stream=stream,
                    records=[protocol.AppendItem(key=key, event=event, payload=body,
                                                 ledger=ledger)
                             for event, body, key, ledger in records]))
            return frame

        answer = self._send_until_stored(encode, "m", "append_many")
        if type(answer) is appendwire.AppendManyOkFrame:
            reply = answer
        elif isinstance(answer, protocol.AppendManyOk):
            reply = appendwire.AppendManyOkFrame(
                msg_id=answer.msg_id, seq=answer.seq, count=answer.count,
                prev_seq=answer.prev_seq, duplicate=answer.duplicate, v=1)
        else:
            raise ProtocolError("unexpected_message",
                                f"append_many answered with {_kind(answer)}")
        if self._journal_dir is not None:
            journal = self._journal(origin)
            for i, (_, _, key, _) in enumerate(records):
                journal.record(key, reply.seq + i)
        return reply

    def read_page(self, stream: str, from_seq: int = 1, max_records: int = 512) -> protocol.Records:
        reply = self._req.request(
            protocol.ReadStream(
                msg_id=new_msg_id("r"), stream=stream, from_seq=from_seq, max_records=max_records
            ),
            timeout_s=self.timeout_s,
            retries=self.retries,
        )
        if not isinstance(reply, protocol.Records):
            raise ProtocolError("unexpected_message", f"read answered with {reply.kind}")
        return reply

    def read_stream(self, stream: str, from_seq: int = 1, page: int = 512) -> Iterator[WalRecord]:
        """Every durable record of `stream` with seq >= from_seq, in order."""
        while True:
            reply = self.read_page(stream, from_seq, page)
            for line in reply.records:
                record = parse_record(line + b"\n")
                if record is None:
                    raise ProtocolError(
                        "internal_error", f"writer sent a damaged record of {stream}"
                    )
                yield record
            if not reply.more:
                return
            from_seq = reply.next_seq

    def ping(self, timeout_s: float | None = None, retries: int | None = None) -> protocol.Pong:
        reply = self._req.request(
            protocol.Ping(msg_id=new_msg_id("p")),
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            retries=self.retries if retries is None else retries,
        )
        if not isinstance(reply, protocol.Pong):
            raise ProtocolError("unexpected_message", f"ping answered with {reply.kind}")
        return reply

    def stats(self) -> dict[str, int | float]:
        reply = self._req.request(
            protocol.StatsRequest(msg_id=new_msg_id("s")), timeout_s=self.timeout_s, retries=1
        )
        if not isinstance(reply, protocol.Stats):
            raise ProtocolError("unexpected_message", f"stats answered with {reply.kind}")
        return reply.values

    @property
    def lane(self) -> LaneClient | None:
        return self._lane

    def close(self) -> None:
        self._req.close()
        if self._lane is not None:
            self._lane.close()
        for journal in self._journals.values():
            journal.close()
        self._journals.clear()

    def __enter__(self) -> WriterClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
