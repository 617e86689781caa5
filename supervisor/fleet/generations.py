"""Host loss: agents' state generations uploaded, and an adopted one restored.

Only a generation the dead host's stream vouches for is taken, renumbered to
this host's seqs. See docs/fleet.md ("Generations").
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from actors.kernel import generations
from broker.statedir import StateDir
from supervisor.fleet import purges, renumber
from supervisor.fleet.natsclient import OBJECTS_BUCKET

log = structlog.get_logger("supervisor.fleet")

KEPT = 3  # generations per agent in the object store
MAX_BYTES = 16 * 1024 * 1024  # a generation larger than this is neither uploaded nor read
_FILE = re.compile(r"^gen-(\d{20})\.json$")


def gen_object(host: str, agent: str, seq: int) -> str:
    return f"{host}/{agent}/gen.{seq:020d}"


def parse_gen(name: str, host: str, agent: str) -> int | None:
    """The seq of one of `host`'s generation objects of `agent`, else None."""
    prefix = f"{host}/{agent}/gen."
    if not name.startswith(prefix):
        return None
    digits = name[len(prefix):]
    return int(digits) if len(digits) == 20 and digits.isdigit() else None


# --- upload --------------------------------------------------------------------
@dataclass
class GenerationUploader:
    """Keeps the newest generations of this host's agents in the object store,
    none in a purged session's range (supervisor/fleet/purges.py): those are
    never uploaded, and deleted from the store on the round after the purge;
    and this host's purge ranges as `<host>/purges` (what an adopter skips)."""

    host: str
    state_dir: StateDir
    stored: dict[str, list[int]] = field(default_factory=dict)  # agent -> seqs, oldest first
    uploads: int = 0
    uploaded_bytes: int = 0
    too_large: set[tuple[str, int]] = field(default_factory=set)
    purged: purges.PurgeWatch = field(init=False)
    purges_sent: bytes | None = None  # the purges object as last uploaded
    deleted_purged: int = 0  # generations deleted from the store for a purge

    def __post_init__(self) -> None:
        self.purged = purges.PurgeWatch(self.state_dir)

    async def sync(self, bucket_of: Callable[[], Awaitable[Any]], agents: Sequence[str],
                   names_of: Callable[[Any], Awaitable[list[str]]]) -> int:
        """Upload the generations made since the last round; how many."""
        ranges = self.purged.read(agents)
        bucket: Any = None
        names: list[str] | None = None
        done = 0
        data = purges.encode(ranges)
        if self.purges_sent is None and not ranges:
            self.purges_sent = data  # none here: nothing for an adopter to skip
        elif data != self.purges_sent:
            bucket = await bucket_of()
            # before any generation is deleted: an adopter that reads the
            # stream meanwhile already skips the range
            await bucket.put(purges.purges_object(self.host), data)
            self.purges_sent = data
        for agent in agents:
            stream = f"agent/{agent}"
            local = [s for s in self._local(agent) if (agent, s) not in self.too_large
                     and not purges.covered(ranges, stream, s)]
            known = self.stored.get(agent)
            dead = stream in ranges and (
                known is None or any(purges.covered(ranges, stream, s) for s in known))
            if not dead and (not local or (known is not None and not _new(local, known))):
                continue
            if bucket is None:
                bucket = await bucket_of()
            if known is None:  # first round for this agent: what an earlier run left there
                if names is None:
                    names = await names_of(bucket)
                known = sorted(s for n in names
                               if (s := parse_gen(n, self.host, agent)) is not None)
                self.stored[agent] = known
            for seq in [s for s in known if purges.covered(ranges, stream, s)]:
                await _delete_once(bucket, gen_object(self.host, agent, seq))
                known.remove(seq)
                self.deleted_purged += 1
                log.info("fleet_generation_purged", agent=agent, seq=seq)
            for seq in _new(local, known):
                raw = self._read(agent, seq)
                if raw is None:
                    continue  # pruned meanwhile, or too large
                await bucket.put(gen_object(self.host, agent, seq), raw)
                known.append(seq)
                known.sort()
                done += 1
                self.uploaded_bytes += len(raw)
            while len(known) > KEPT:  # bounded: the oldest go once newer ones are up
                old = known.pop(0)
                with contextlib.suppress(Exception):  # deleted meanwhile: the same
                    await bucket.delete(gen_object(self.host, agent, old))
        self.uploads += done
        return done

    def _local(self, agent: str) -> list[int]:
        """The seqs of the agent's generation files here, oldest first."""
        out = []
        for path in generations.list_generations(self.state_dir.agent_dir(agent)):
            match = _FILE.match(path.name)
            if match:
                out.append(int(match.group(1)))
        return out[-KEPT:]

    def _read(self, agent: str, seq: int) -> bytes | None:
        path = generations.generations_dir(self.state_dir.agent_dir(agent)) / \
            f"gen-{seq:020d}.json"
        try:
            if path.stat().st_size > MAX_BYTES:
                if (agent, seq) not in self.too_large:
                    self.too_large.add((agent, seq))
                    log.warning("fleet_generation_too_large", agent=agent, seq=seq,
                                limit=MAX_BYTES)
                return None
            return path.read_bytes()
        except FileNotFoundError:
            return None


async def _delete_once(bucket: Any, name: str) -> None:
    """Delete the object (gone already: the same); any other failure is
    raised, so the round fails and the next one deletes it."""
    from nats.js.errors import ObjectDeletedError, ObjectNotFoundError  # noqa: PLC0415

    with contextlib.suppress(ObjectNotFoundError, ObjectDeletedError):
        await bucket.delete(name)


def _new(local: list[int], known: list[int]) -> list[int]:
    """The local generations to upload: not in the store, and not older than
    every one it keeps."""
    full = len(known) >= KEPT
    return [s for s in local if s not in known and not (full and s < known[0])]


# --- download and choice ---------------------------------------------------------
async def download(bucket: Any, names: list[str], host: str, agent: str
                   ) -> list[tuple[int, bytes]]:
    """`host`'s generations of `agent` in the object store, newest first (at
    most KEPT, each at most MAX_BYTES; one that cannot be read is left out)."""
    seqs = sorted((s for n in names if (s := parse_gen(n, host, agent)) is not None),
                  reverse=True)[:KEPT]
    found: list[tuple[int, bytes]] = []
    for seq in seqs:
        name = gen_object(host, agent, seq)
        try:
            info = await bucket.get_info(name)
            if int(info.size or 0) > MAX_BYTES:
                log.warning("fleet_generation_refused", host=host, agent=agent, seq=seq,
                            reason="too large")
                continue
            found.append((seq, bytes((await bucket.get(name)).data or b"")))
        except Exception as exc:  # noqa: BLE001 - gone or damaged in the store: not used
            log.warning("fleet_generation_refused", host=host, agent=agent, seq=seq,
                        reason=f"unreadable: {type(exc).__name__}")
    return found


def choose(candidates: Sequence[tuple[int, bytes]], records: Sequence[dict[str, Any]],
           agent: str, through_seq: int) -> tuple[generations.Generation | None,
                                                  list[tuple[int, str]]]:
    """The newest candidate the dead host's stream vouches for, at or below
    `through_seq` (the last record adopted); and the reasons the others were
    skipped. `records`: the dead host's records (every stream), as parsed."""
    mine = [r for r in records if r.get("stream") == f"agent/{agent}"]
    at = {r["seq"]: r for r in mine if isinstance(r.get("seq"), int)}
    vouched = {(p.get("seq"), p.get("sha256")) for r in mine
               if r.get("event") == generations.SAVED_EVENT
               and isinstance(p := r.get("payload"), dict)}
    refused: list[tuple[int, str]] = []
    for seq, raw in sorted(candidates, key=lambda c: c[0], reverse=True):
        if seq > through_seq:
            refused.append((seq, "after the cut"))
            continue
        if (seq, hashlib.sha256(raw).hexdigest()) not in vouched:
            refused.append((seq, "no generation_saved fact with its digest"))
            continue
        gen = generations.parse(raw)
        if gen is None or gen.state.last_seq != seq:
            refused.append((seq, "not a generation of that seq"))
            continue
        record = at.get(seq)
        if record is None or (gen.key is not None and record.get("key") != gen.key):
            refused.append((seq, "the stream's record at its seq is another"))
            continue
        return gen, refused
    return None, refused


def renumbered(state: Any, seqs: dict[int, int], rewinds: set[int] | None = None) -> Any:
    """`state` (an AgentState) with its seq-valued fields mapped from the dead
    host's seqs to this host's (`seqs`: old -> new, every adopted record;
    `rewinds`: the old seqs of the adopted rewinds, whose branch fields are
    mapped too: supervisor/fleet/renumber.py); None when one of them is not an
    adopted record's."""
    out = renumber.renumber_branch(state.model_copy(deep=True), seqs, rewinds or set())
    if out is None:
        return None
    if state.last_seq not in seqs:
        return None
    out.last_seq = seqs[state.last_seq]
    if state.session_seq:
        if state.session_seq not in seqs:
            return None
        out.session_seq = seqs[state.session_seq]
    return out


def restore(state_dir: StateDir, dead: str, agent: str, *,
            candidates: Sequence[tuple[int, bytes]], records: Sequence[dict[str, Any]],
            adopted: Sequence[dict[str, Any]], new_seqs: Sequence[int]) -> int:
    """Blocking, after the import: write the newest usable generation as this
    host's (renumbered) and append the fact vouching for it; its new seq, or 0
    when none is usable (the agent then folds its whole adopted stream). A
    generation only saves time: its failure never fails the adoption."""
    try:
        return _restore(state_dir, dead, agent, candidates, records, adopted, new_seqs)
    except Exception as exc:  # noqa: BLE001 - the full fold instead
        log.warning("fleet_generation_refused", host=dead, agent=agent,
                    reason=f"restore failed: {type(exc).__name__}: {str(exc)[:200]}")
        return 0


def _restore(state_dir: StateDir, dead: str, agent: str,  # noqa: PLR0917
             candidates: Sequence[tuple[int, bytes]], records: Sequence[dict[str, Any]],
             adopted: Sequence[dict[str, Any]], new_seqs: Sequence[int]) -> int:
    through = max((r["seq"] for r in adopted if isinstance(r.get("seq"), int)), default=0)
    gen, refused = choose(candidates, records, agent, through)
    for seq, reason in refused:
        log.warning("fleet_generation_refused", host=dead, agent=agent, seq=seq, reason=reason)
    if gen is None:
        return 0
    seqs = {int(r["seq"]): new for r, new in zip(adopted, new_seqs, strict=True)}
    rewinds = {int(r["seq"]) for r in adopted if r.get("event") == renumber.REWIND}
    state = renumbered(gen.state, seqs, rewinds)
    if state is None:
        log.warning("fleet_generation_refused", host=dead, agent=agent,
                    seq=gen.state.last_seq, reason="a seq it names was not adopted")
        return 0
    digest = generations.write(state_dir.agent_dir(agent), agent, state, key=gen.key)
    _vouch(state_dir, agent, state.last_seq, digest)
    log.info("fleet_generation_restored", host=dead, agent=agent,
             dead_seq=gen.state.last_seq, seq=state.last_seq)
    return int(state.last_seq)


def _vouch(state_dir: StateDir, agent: str, seq: int, digest: str) -> None:
    import zmq  # noqa: PLC0415

    from actors.writer.client import WriterClient  # noqa: PLC0415
    from broker import auth  # noqa: PLC0415

    event, payload, _ = generations.saved_fact(seq, digest)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, state_dir, agent,
                          credential=auth.operator_credential(state_dir)) as writer:
            writer.append(f"agent/{agent}", event, payload, key=f"g{seq}:adopted", origin=agent)
    finally:
        ctx.destroy(linger=0)


def uploaded_generations(urls: list[str], host: str, agent: str) -> list[int]:
    """The seqs of `host`'s generations of `agent` in the object store, oldest
    first ([] when none, or the cluster is away). For the tests and benchmarks
    that wait for an upload."""
    import asyncio  # noqa: PLC0415

    import nats  # noqa: PLC0415


    async def go() -> list[int]:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            bucket = await nc.jetstream(timeout=5).object_store(OBJECTS_BUCKET)
            return sorted(s for i in await bucket.list() if not i.deleted
                          and (s := parse_gen(i.name, host, agent)) is not None)
        except Exception:  # noqa: BLE001 - nothing uploaded yet
            return []
        finally:
            await nc.close()

    return asyncio.run(go())
