"""The agent's stream as its loop writes it (actors/agent/loop.py explains
when the loop flushes): each fact folded into the state at once and kept
pending, the pending facts made durable together (`flush`: one
`append_many`, one fdatasync), the stream's other records (an operator's
answer) folded in (`sync`), and the snapshot generations the fold makes due,
each with the fact that vouches for it, the compaction file pruned with them
(docs/agents.md, docs/storage.md)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from actors.kernel import compaction, generations
from actors.kernel.fold import fold_into
from actors.kernel.settings import AgentSettings
from actors.kernel.state import AgentState, Event
from actors.sessions import rebuild
from actors.trees import recorder
from actors.writer.client import WriterClient, decode_payload, encode_payload
from broker import protocol
from broker.errors import WalError
from broker.statedir import StateDir

GROUP_MAX_RECORDS = 64  # pending facts flushed at once beyond these bounds
GROUP_MAX_BYTES = 256 * 1024
Pending = tuple[str, bytes, str, protocol.LedgerName | None]  # event, body, key, ledger


class Journal:
    """The state of one agent's stream and the facts folded into it that are
    not durable yet. `busy(op, deadline_s)` declares a blocking call (the
    heartbeats go on); `refold()` rebuilds the state from the stream, when an
    append finds others' records (or a retry's answer) before its own."""

    def __init__(self, name: str, state_dir: StateDir, writer: WriterClient, *,
                 settings: AgentSettings, trees: recorder.TreeRecorder, log: Any,
                 busy: Callable[[str, float], AbstractContextManager[None]],
                 refold: Callable[[], object]) -> None:
        self.name = name
        self.writer = writer
        self.settings = settings
        self.trees = trees
        self.log = log
        self._busy = busy
        self._refold = refold
        self.stream = rebuild.stream_of(name)
        self.agent_dir = state_dir.agent_dir(name)
        self.state = AgentState()
        self.pending: list[Pending] = []  # folded, not yet durable (flush())
        self._pending_bytes = 0
        self._pending_base = 0  # state.last_seq before the first pending fact
        self.facts_appended = 0  # facts appended (folded, maybe not yet flushed)
        self.since_generation = 0  # events folded since the last generation
        self._prune_compactions_over = compaction.PRUNE_OVER_BYTES

    def append_deadline_s(self) -> float:
        """How long an append may wait: every attempt of the writer client."""
        timeout = float(getattr(self.writer, "timeout_s", 0.0))
        return timeout * (int(getattr(self.writer, "retries", 0)) + 1)

    def sync(self) -> None:
        """Fold whatever the stream holds after our last seq."""
        self.flush()
        with self._busy("read", self.append_deadline_s()):
            records = list(self.writer.read_stream(self.stream, self.state.last_seq + 1))
        if records:
            self.fold([(r.seq, r.event, r.payload()) for r in records], records[-1].key)

    def fold(self, events: list[Event], last_key: str) -> None:
        fold_into(self.state, events)  # the journal owns its state: no copy
        self._folded(len(events), events[-1][1], last_key)

    def _folded(self, count: int, last_event: str, last_key: str) -> None:
        """`count` more events are folded (durable, at their seqs): write a
        generation when due, and append the fact that vouches for it."""
        self.since_generation += count
        if (self.since_generation >= self.settings.snapshot_every
                and last_event != generations.SAVED_EVENT):
            seq = self.state.last_seq
            self.since_generation = 0
            try:
                digest = generations.write(self.agent_dir, self.name, self.state,
                                           keep=self.settings.generations_kept, key=last_key)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # derived (a rebuild folds from an older one): skipped on a full disk,
                # written again `snapshot_every` events later (docs/storage.md)
                self.log.warning("generation_skipped", seq=seq, error=exc.strerror)
                return
            event, payload, key = generations.saved_fact(seq, digest)
            self.append(event, payload, key)  # the WAL vouches for the file's content
            self._prune_compactions()

    def _prune_compactions(self) -> None:
        """Bound the compaction file (docs/storage.md): once it has grown past a
        mark, keep only the lines something still readable names (a record
        retention left in this stream, a kept generation, the state now)."""
        path = compaction.path_of(self.agent_dir)
        try:
            size = path.stat().st_size
        except OSError:
            return
        if size < self._prune_compactions_over:
            return
        keep = compaction.refs_of(self.state)
        for kept in generations.list_generations(self.agent_dir):
            generation = generations.read(kept)
            if generation is not None:
                keep |= compaction.refs_of(generation.state)
        for record in self.writer.read_stream(self.stream, 1):
            if record.event in ("compaction_recorded", "session_fork"):
                keep |= compaction.named_by(record.event, record.payload())
        dropped = compaction.prune(self.agent_dir, keep)
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        self._prune_compactions_over = max(compaction.PRUNE_OVER_BYTES,
                                           compaction.PRUNE_GROWTH * size)
        if dropped:
            self.log.info("compaction_file_pruned", lines=dropped, bytes=size)

    def append(self, event: str, payload: dict[str, Any], key: str,
               ledger: protocol.LedgerName | None = None, *, scoped: bool = True) -> None:
        """Fold a fact now and keep it pending; `flush()` makes it durable."""
        if scoped:
            if self.state.session is not None:
                key = f"{self.state.session}.{key}"  # keys repeat from session to session
            key = self.state.branch + key  # a rewound branch runs its turns again under new keys
        body = encode_payload(payload)
        if not self.pending:
            self._pending_base = self.state.last_seq
        self.facts_appended += 1
        self.pending.append((event, body, key, ledger))
        self._pending_bytes += len(body)
        # folded at the seq it gets if nothing of the stream comes between (flush checks)
        fold_into(self.state, [(self.state.last_seq + 1, event, decode_payload(body))])
        if len(self.pending) >= GROUP_MAX_RECORDS or self._pending_bytes >= GROUP_MAX_BYTES:
            self.flush()

    def flush(self) -> None:
        """Make the pending facts durable: one `append_many`, one fdatasync (and
        one more when that made a generation due: the fact that vouches for it)."""
        while self.pending:
            self._flush_once()
        self.trees.released()  # a tree the facts name is durable, and they are

    def _flush_once(self) -> None:
        self.trees.settle()  # the objects of a tree a pending fact names are durable
        group, self.pending, self._pending_bytes = self.pending, [], 0
        base = self._pending_base
        with self._busy("append", self.append_deadline_s()):
            ok = self.writer.append_many(self.stream, group)
        if not ok.duplicate and ok.seq <= base:
            # the WAL head went back under us (records we folded are gone): rebuild
            raise WalError(f"append {group[0][2]} got seq {ok.seq} <= folded seq {base}: "
                           "the WAL lost records; restart to rebuild")
        if not ok.duplicate and ok.prev_seq == base:
            # nothing of our stream came between the last record we had folded and
            # the group: the stream holds exactly what we folded, at these seqs
            self.state.last_seq = ok.seq + ok.count - 1
            self._folded(len(group), group[-1][0], group[-1][2])
        else:
            # others' records of our stream (an operator's answer) came first, or a
            # retry was answered: fold the stream as it is
            self.log.info("state_refolded", reason="duplicate" if ok.duplicate else "interleaved")
            self._refold()
