"""Host loss, second half: bundles uploaded, a dead host's agents adopted.

An adopted agent resumes at the cut (the newest tree whose objects are
held); the records after it are not adopted and that turn runs again.
See docs/fleet.md ("Adoption") and docs/decisions.md ("Adoption by the
fencer, at the newest uploaded tree").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from actors.kernel.settings import read_spec, spec_path
from actors.trees import tree as trees
from actors.trees.store import (
    MAGIC,
    CorruptObjectError,
    ObjectStore,
    encode_objects,
    pack_digests,
    packs_dir,
)
from actors.trees.store import lease as store_lease
from broker.durable import write_atomic
from broker.statedir import StateDir
from supervisor.fleet import bundle, generations, purges, renumber
from supervisor.fleet.natsclient import OBJECTS_BUCKET
from supervisor.fleet.replicate import parse_seq_range, stream_name

log = structlog.get_logger("supervisor.fleet")
# tests only: seconds each agent's adoption sleeps first (in the executor), as a
# long stream on a loaded host would take (tests/test_soak_fleet_hosts.py)
FAULT_DELAY_ENV = "CORRAL_FAULT_ADOPT_DELAY_S"

OBJECTS = OBJECTS_BUCKET
MAX_CHUNKS = 64  # chunks of one pack generation before the next is uploaded whole
PROC_ID = re.compile(r"^[pt]-[0-9a-f]{16}$")  # actors/procs/host.py new_proc_id
IMPORT_CHUNK = 64


def pack_object(host: str, agent: str) -> str:
    return f"{host}/{agent}/pack"


def spec_object(host: str, agent: str) -> str:
    return f"{host}/{agent}/spec"


async def objects_bucket(js: Any, replicas: int) -> Any:
    from nats.js.api import ObjectStoreConfig, StorageType  # noqa: PLC0415
    from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

    try:
        return await js.object_store(OBJECTS)
    except BucketNotFoundError:
        return await js.create_object_store(OBJECTS, config=ObjectStoreConfig(
            bucket=OBJECTS, replicas=replicas, storage=StorageType.FILE))


def agent_names(state_dir: StateDir) -> list[str]:
    """The agents with a spec on this host (the ones a bundle is kept for)."""
    directory = spec_path(state_dir, "x").parent
    with contextlib.suppress(OSError):
        return sorted(p.stem for p in directory.glob("*.json"))
    return []


def spec_bundle(state_dir: StateDir, agent: str) -> bytes | None:
    """What the agent was started with: backend, model, replay stream, task text."""
    spec = read_spec(state_dir, agent)
    if spec is None:
        return None
    try:
        task = Path(spec.task).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return json.dumps({"backend": spec.backend, "model": spec.model,
                       "replay_stream": spec.replay_stream, "task": task}).encode()


@dataclass
class _Sent:
    ident: tuple[int, int]  # the pack file's (device, inode): a collection replaces it
    size: int  # bytes of it in the object store
    gen: str  # the chunks' generation
    chunks: int
    spec: bytes
    # the extras (supervisor/fleet/bundle.py), per generation:
    parsed: int = 0  # the pack's bytes whose objects are in `present`
    present: set[str] = field(default_factory=set)  # objects in the bundle: pack and extras
    closed: set[str] = field(default_factory=set)  # trees whose closure the bundle holds
    extra: int = 0  # bytes of extras uploaded (the next extra chunk's offset)
    # the agent's purged ranges when the generation began: a new purge starts
    # another, so no extras chunk of a purged tree outlives the round
    purged: tuple[tuple[int, int], ...] = ()


@dataclass
class Uploader:
    """Keeps this host's bundles in the object store (one per agent). The pack
    is append-only until a collection replaces it, so each round uploads only
    what was appended since the last one, as one chunk object
    `<host>/<agent>/pack.<gen>@<offset>`; a replaced or shrunk pack, or one
    in more than MAX_CHUNKS chunks, or a new purge of one of the agent's
    sessions (supervisor/fleet/purges.py), starts a new generation uploaded
    whole, and the older generations' chunks are deleted after it."""

    host: str
    state_dir: StateDir
    replicas: int
    sent: dict[str, _Sent] = field(default_factory=dict)
    uploads: int = 0
    uploaded_bytes: int = 0
    generations: generations.GenerationUploader | None = None
    extra_bytes: int = 0  # of `uploaded_bytes`, the extras'
    trees: bundle.NewestTrees | None = None
    store: ObjectStore | None = None  # this host's, read for the extras

    async def sync(self, js: Any) -> int:
        """Upload what changed since the last round; how many agents' bundles
        (their generations too: supervisor/fleet/generations.py)."""
        if self.generations is None:
            self.generations = generations.GenerationUploader(self.host, self.state_dir)
        agents = agent_names(self.state_dir)
        done = await self._sync_packs(js, agents, self.generations.purged.read(agents))
        await self.generations.sync(lambda: objects_bucket(js, self.replicas),
                                    [a for a in agents if a in self.sent], _names)
        return done

    async def _sync_packs(self, js: Any, agents: list[str], ranges: purges.Ranges) -> int:
        bucket = None
        done = 0
        if self.trees is None:
            self.trees = bundle.NewestTrees(self.state_dir.wal_dir)
        # before the packs: a tree read has its objects there (durable before its fact)
        await asyncio.get_running_loop().run_in_executor(None, self.trees.read)
        newest = _unpurged(self.trees, ranges)
        for agent in agents:
            spec = spec_bundle(self.state_dir, agent)
            if spec is None:
                continue
            pack = packs_dir(self.state_dir.root) / f"{agent}.pack"
            try:
                st = pack.stat()
                ident, size = (st.st_dev, st.st_ino), st.st_size
            except FileNotFoundError:
                ident, size = (0, 0), 0
            known = self.sent.get(agent)
            tree = newest.get(agent)
            purged = tuple(sorted((p.first_seq, p.last_seq)
                                  for p in ranges.get(f"agent/{agent}", ())))
            if known is not None and (known.ident, known.size, known.spec, known.purged) == (
                    ident, size, spec, purged) and (tree is None or tree in known.closed):
                continue
            if bucket is None:
                bucket = await objects_bucket(js, self.replicas)
            if known is None or known.ident != ident or size < known.size \
                    or known.chunks >= MAX_CHUNKS or known.purged != purged:
                known = await self._start(bucket, agent, pack, ident, spec)
                known.purged = purged
            elif size > known.size:
                with pack.open("rb") as f:
                    f.seek(known.size)
                    tail = f.read(size - known.size)
                await bucket.put(chunk_object(self.host, agent, known.gen, known.size), tail)
                known.size += len(tail)
                known.chunks += 1
                self.uploaded_bytes += len(tail)
            if known.spec != spec:
                await bucket.put(spec_object(self.host, agent), spec)
                known.spec = spec
            if tree is not None:
                await self._sync_extras(bucket, agent, pack, known, tree)
            self.sent[agent] = known
            done += 1
        self.uploads += done
        return done

    async def _sync_extras(self, bucket: Any, agent: str, pack: Path, known: _Sent,
                           tree: str) -> None:
        """The objects of the agent's newest tree its bundle lacks, as one chunk
        `extra.<gen>@<offset>` (supervisor/fleet/bundle.py)."""
        try:
            with pack.open("rb") as f:
                if (os.fstat(f.fileno()).st_dev, os.fstat(f.fileno()).st_ino) != known.ident:
                    return  # replaced since: the next round starts a generation
                names, known.parsed = pack_digests(f, known.parsed, known.size)
                known.present.update(names)
        except FileNotFoundError:
            if known.ident != (0, 0):
                return
        if tree in known.closed:
            return
        if self.store is None:
            self.store = ObjectStore(packs_dir(self.state_dir.root), "fleet-uploader")
        store = self.store
        found = await asyncio.get_running_loop().run_in_executor(
            None, lambda: bundle.missing(store.get, tree, known.present, known.closed))
        if found.objects:
            data = (MAGIC if known.extra == 0 else b"") + encode_objects(found.objects)
            await bucket.put(chunk_object(self.host, agent, known.gen, known.extra, "extra"), data)
            known.extra += len(data)
            known.chunks += 1
            known.present.update(name for name, _ in found.objects)
            self.uploaded_bytes += len(data)
            self.extra_bytes += len(data)
        known.closed.update(found.closed)

    async def _start(self, bucket: Any, agent: str, pack: Path, ident: tuple[int, int],
                     spec: bytes) -> _Sent:
        """A new generation: the whole pack as its first chunk; then the other
        generations' chunks (and a whole-pack object of older versions) deleted."""
        data = pack.read_bytes() if ident != (0, 0) else b""
        gen = f"{time.time_ns():x}"
        await bucket.put(spec_object(self.host, agent), spec)
        await bucket.put(chunk_object(self.host, agent, gen, 0), data)
        self.uploaded_bytes += len(data)
        for name in await _names(bucket):
            parsed = parse_chunk(name, self.host, agent) or \
                parse_chunk(name, self.host, agent, "extra")
            if (parsed is not None and parsed[0] != gen) or name == pack_object(self.host, agent):
                with contextlib.suppress(Exception):  # deleted meanwhile: the same
                    await bucket.delete(name)
        return _Sent(ident, len(data), gen, 1, spec)


def _unpurged(newest: bundle.NewestTrees, ranges: purges.Ranges) -> dict[str, str]:
    """Per agent, the tree its newest tree-bearing record names, unless a
    purge covers that record (no object is sent for a purged tree)."""
    return {agent: tree for agent, (seq, tree) in newest.newest.items()
            if not purges.covered(ranges, f"agent/{agent}", seq)}


async def _names(bucket: Any) -> list[str]:
    """The bucket's object names; [] for an empty bucket (nats raises
    NotFoundError for it). Any other failure (a timeout while the bucket's
    stream elects a leader, the connection lost) is raised: read as "no
    objects", it made an adopter record a dead host adopted with none of its
    agents, which nobody then adopted (found by CI's fleet soak)."""
    from nats.js.errors import NotFoundError  # noqa: PLC0415

    try:
        infos = await bucket.list()
    except NotFoundError:
        return []
    return [i.name for i in infos if not getattr(i, "deleted", False)]


FETCH_RETRY_S = 60.0  # how long an adopter retries a bundle's transient read failures


async def _fetch_bundle(bucket: Any, names: list[str], dead: str, agent: str
                        ) -> tuple[Any, bytes, Any, Any]:
    """An agent's spec, pack, extras and generations from the object store.
    A missing object (a bundle half uploaded) is raised at once; a transient
    failure (a timeout or no responders while the cluster elects a leader
    after losing a node, often the dead host's own) is retried with backoff
    for up to FETCH_RETRY_S, then raised, so the adoption round fails and is
    tried again rather than skipping the agent for good."""
    from nats.errors import Error as NatsError  # noqa: PLC0415
    from nats.js.errors import NotFoundError  # noqa: PLC0415

    deadline = time.monotonic() + FETCH_RETRY_S
    delay = 0.25
    while True:
        try:
            spec = json.loads((await bucket.get(spec_object(dead, agent))).data or b"{}")
            pack = await download_pack(bucket, names, dead, agent)
            extras = await download_extras(bucket, names, dead, agent)
            gens = await generations.download(bucket, names, dead, agent)
        except NotFoundError:
            raise
        except (NatsError, TimeoutError, ConnectionError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("fleet_adopt_fetch_retry", host=dead, agent=agent,
                        error=type(exc).__name__, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 4.0)
        else:
            return spec, pack, extras, gens


def chunk_object(host: str, agent: str, gen: str, offset: int, kind: str = "pack") -> str:
    return f"{host}/{agent}/{kind}.{gen}@{offset}"


def parse_chunk(name: str, host: str, agent: str, kind: str = "pack") -> tuple[str, int] | None:
    """(generation, offset) of one of `host`'s chunks of `agent`'s pack (or, `kind`
    "extra", of its extras: supervisor/fleet/bundle.py), else None."""
    prefix = f"{host}/{agent}/{kind}."
    if not name.startswith(prefix):
        return None
    gen, sep, offset = name[len(prefix):].partition("@")
    if not sep or not re.fullmatch(r"[0-9a-f]{1,32}", gen) or not offset.isdigit() \
            or len(offset) > 15:
        return None
    return gen, int(offset)


async def download_pack(bucket: Any, names: list[str], host: str, agent: str) -> bytes:
    """The agent's pack as uploaded: the newest generation's chunks, contiguous
    from offset 0 (a gap ends it: a shorter pack only means an older cut); a
    whole-pack object of an older version when there are no chunks."""
    gens: dict[str, dict[int, str]] = {}
    for name in names:
        parsed = parse_chunk(name, host, agent)
        if parsed is not None:
            gens.setdefault(parsed[0], {})[parsed[1]] = name
    whole = [g for g, chunks in gens.items() if 0 in chunks]
    if not whole:
        if pack_object(host, agent) in names:
            return bytes((await bucket.get(pack_object(host, agent))).data or b"")
        return b""
    return await _join(bucket, gens[max(whole, key=lambda g: (len(g), g))])


async def _join(bucket: Any, chunks: dict[int, str]) -> bytes:
    """The chunks (offset -> object name) contiguous from offset 0."""
    data = bytearray()
    while (chunk := chunks.get(len(data))) is not None:
        part = (await bucket.get(chunk)).data or b""
        if not part:
            break
        data += part
    return bytes(data)


async def download_extras(bucket: Any, names: list[str], host: str, agent: str) -> bytes:
    """The agent's extras (supervisor/fleet/bundle.py) of the pack generation
    `download_pack` takes, joined as it joins the pack: a pack of their own."""
    gens: dict[str, dict[int, str]] = {}
    for name in names:
        parsed = parse_chunk(name, host, agent)
        if parsed is not None and parsed[1] == 0:
            gens[parsed[0]] = {}
    if not gens:
        return b""
    gen = max(gens, key=lambda g: (len(g), g))
    chunks: dict[int, str] = {}
    for name in names:
        parsed = parse_chunk(name, host, agent, "extra")
        if parsed is not None and parsed[0] == gen:
            chunks[parsed[1]] = name
    return await _join(bucket, chunks)


def take_bundle(packs: Path, agent: str, pack: bytes, extras: bytes) -> ObjectStore:
    """The agent's bundle written into the store at `packs` (its pack as
    `<agent>.pack`, its extras as `<agent>+bundle.pack`); the store, validated.
    The caller holds the collection lease."""
    if pack:
        write_atomic(packs / f"{agent}.pack", pack)
    if extras:
        write_atomic(packs / f"{agent}{bundle.BUNDLE_SUFFIX}.pack", extras)
    store = ObjectStore(packs, agent)
    store.validate()
    return store


def uploaded_pack_size(urls: list[str], host: str, agent: str) -> int:
    """How many bytes of `host`'s pack of `agent` the object store holds as an
    adopter would read them; -1 when none is there (or the cluster is away).
    For the tests and benchmarks that wait for an upload."""
    import asyncio  # noqa: PLC0415

    import nats  # noqa: PLC0415

    async def go() -> int:
        nc: Any = await nats.connect(urls, connect_timeout=2)
        try:
            bucket = await nc.jetstream(timeout=5).object_store(OBJECTS)
            names = [i.name for i in await bucket.list() if not i.deleted]
            if not any(n.startswith(f"{host}/{agent}/pack.") for n in names):
                return -1
            return len(await download_pack(bucket, names, host, agent))
        except Exception:  # noqa: BLE001 - not uploaded yet
            return -1
        finally:
            await nc.close()

    return asyncio.run(go())


# --- adoption ------------------------------------------------------------------
async def stream_records(js: Any, host: str) -> list[dict[str, Any]]:
    """Every record of `host`'s stream, parsed, in seq order (fences skipped)."""
    from nats.js.errors import NotFoundError  # noqa: PLC0415

    name = stream_name(host)
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        return []
    records: list[dict[str, Any]] = []
    if int(info.state.messages) == 0:
        return records
    for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
        try:
            msg = await js.get_msg(name, seq)
        except NotFoundError:
            continue
        headers = msg.headers or {}
        if "Corral-Seq" not in headers:
            continue  # a fence
        parse_seq_range(headers["Corral-Seq"])  # refuses a malformed header
        for line in (msg.data or b"").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not a record: never adopted
            if isinstance(record, dict):
                records.append(record)
    return records


def tree_present(store: ObjectStore, digest: str) -> bool:
    """True when every object below the tree `digest` is in the store (and sound)."""
    try:
        for entry in trees.flatten(store.get, digest).values():
            store.get(entry.digest)
    except (CorruptObjectError, trees.TreeFormatError, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class Cut:
    records: list[dict[str, Any]]  # the agent's records to adopt, in order
    tree: str | None  # the tree they end with (None: nothing to adopt)
    dropped: int  # the agent's records after the cut (that turn runs again)
    newest_tree: str | None  # the newest tree the stream names


def cut(records: list[dict[str, Any]], agent: str, store: ObjectStore) -> Cut:
    """The agent's records up to and including its newest `workspace_tree` (or
    `rewind`: the tree it restored) whose objects `store` holds; none when there
    is no such tree (the agent starts over)."""
    mine = [r for r in records if r.get("stream") == f"agent/{agent}"]
    newest: str | None = None
    for index in range(len(mine) - 1, -1, -1):
        record = mine[index]
        if record.get("event") not in ("workspace_tree", "rewind"):
            continue  # a rewind is a turn boundary too: its tree is the workspace it leaves
        payload = record.get("payload")
        payload = payload if isinstance(payload, dict) else {}
        digest = payload.get("tree")
        if record.get("event") == "rewind" and digest is None:
            # a rewind to before any tree restores nothing (actors/trees/rewind.py):
            # the workspace it leaves is the one it captured first
            digest = payload.get("from_tree")
        if not isinstance(digest, str):
            continue
        newest = newest or digest
        if tree_present(store, digest):
            return Cut(mine[: index + 1], digest, len(mine) - index - 1, newest)
    return Cut([], None, len(mine), newest)


@dataclass(frozen=True)
class Adopted:
    agent: str
    tree: str | None
    records: int
    dropped: int
    tree_behind: bool  # the newest tree named in the stream was not in the object store
    spawned: bool
    detail: str = ""
    lost: list[str] = field(default_factory=list)  # its processes reported lost
    generation: int = 0  # the seq (here) of the generation it rebuilds from; 0: none


def adopt_agent(state_dir: StateDir, dead: str, agent: str, spec: dict[str, Any],  # noqa: PLR0917
                pack: bytes, records: list[dict[str, Any]],
                gens: list[tuple[int, bytes]] | None = None, extras: bytes = b"") -> Adopted:
    """Blocking: one agent of the dead host made to run here (see the module doc);
    `gens`: its generations from the object store (hostile: checked before use);
    `extras`: the objects of its newest tree its pack lacks (bundle.py)."""
    from actors.kernel import workspace as agent_workspace  # noqa: PLC0415
    from actors.trees.restore import restore  # noqa: PLC0415

    if delay := os.environ.get(FAULT_DELAY_ENV):  # tests only: a slow adoption
        time.sleep(float(delay))
    if spec_path(state_dir, agent).exists():
        log.error("fleet_adopt_name_taken", host=dead, agent=agent)
        return Adopted(agent, None, 0, 0, False, False, "name taken on this host")
    packs = packs_dir(state_dir.root)
    packs.mkdir(parents=True, exist_ok=True)
    with store_lease(packs):
        store = take_bundle(packs, agent, pack, extras)
        chosen = cut(records, agent, store)
        renumber.check(chosen.records)  # refused before the workspace is touched
        workspace = state_dir.agent_dir(agent) / "workspace"
        workspace.mkdir(parents=True, exist_ok=True)
        if chosen.tree is not None:
            restore(workspace, store, None, chosen.tree, agent_workspace.guard_for(state_dir))
        seqs = _import(state_dir, agent, chosen.records)
        generation = generations.restore(
            state_dir, dead, agent, candidates=gens or [], records=records,
            adopted=chosen.records, new_seqs=seqs) if seqs else 0
        lost = running_procs(records, agent, _last_seq(chosen.records))
        report_lost(state_dir, agent, dead, lost)
    spawned, detail = _spawn(state_dir, agent, spec, _session_of(chosen.records))
    return Adopted(agent, chosen.tree, len(seqs), chosen.dropped,
                   chosen.newest_tree is not None and chosen.newest_tree != chosen.tree,
                   spawned, detail, [proc_id for proc_id, _ in lost], generation)


def _last_seq(records: list[dict[str, Any]]) -> int:
    seqs = [r["seq"] for r in records if isinstance(r.get("seq"), int)]
    return max(seqs, default=0)


def running_procs(records: list[dict[str, Any]], agent: str, through_seq: int
                  ) -> list[tuple[str, str]]:
    """(proc id, kind) of the agent's commands and terminals started at or before
    `through_seq` (the cut) and not ended in the dead host's stream."""
    running: dict[str, str] = {}
    for record in records:
        if record.get("stream") != f"procs/{agent}":
            continue
        payload = record.get("payload")
        proc_id = payload.get("proc_id") if isinstance(payload, dict) else None
        if not isinstance(proc_id, str) or not PROC_ID.fullmatch(proc_id):
            continue  # hostile or foreign: never a file name
        event = record.get("event")
        seq = record.get("seq")
        if event in ("proc_start", "terminal_start") and isinstance(seq, int) \
                and seq <= through_seq:
            running[proc_id] = "command" if event == "proc_start" else "terminal"
        elif event in ("proc_exit", "terminal_end", "proc_lost"):
            running.pop(proc_id, None)
    return sorted(running.items())


def report_lost(state_dir: StateDir, agent: str, dead: str, procs: list[tuple[str, str]]) -> None:
    """Each process lost with the dead host: its files (so this host's procs
    answers it `lost`) and the `proc_lost` fact (procs' own key: once)."""
    import zmq  # noqa: PLC0415

    from actors.procs.facts import stream_for  # noqa: PLC0415
    from actors.procs.registry import end_path  # noqa: PLC0415
    from actors.writer.client import WriterClient  # noqa: PLC0415
    from broker import auth  # noqa: PLC0415

    if not procs:
        return
    reason = f"lost with host {dead} (its agent was adopted)"
    for proc_id, kind in procs:
        directory = state_dir.agent_dir(agent) / (".procs" if kind == "command" else ".terminals")
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_path = directory / f"{proc_id}.log"
        with contextlib.suppress(FileExistsError):
            os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        write_atomic(Path(end_path(str(log_path))), json.dumps(
            {"state": "lost", "exit_code": None, "reason": reason}).encode())
    stream = stream_for(agent)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, state_dir, agent,
                          credential=auth.operator_credential(state_dir)) as writer:
            for proc_id, kind in procs:
                writer.append(stream, "proc_lost", {"proc_id": proc_id, "kind": kind,
                                                    "reason": reason},
                              key=f"{proc_id}:lost", origin=stream)
    finally:
        ctx.destroy(linger=0)
    log.warning("fleet_procs_lost", host=dead, agent=agent, procs=[p for p, _ in procs])


def _import(state_dir: StateDir, agent: str, records: list[dict[str, Any]]) -> list[int]:
    """Append the records to this host's WAL under their stream, origin and key
    (as the operator; keys make a retried adoption append nothing twice); the
    seq each got here, in order (a retry's duplicates answer the same ones)."""
    import zmq  # noqa: PLC0415

    from actors.writer.client import WriterClient  # noqa: PLC0415
    from broker import auth  # noqa: PLC0415

    if not records:
        return []
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, state_dir, agent,
                          credential=auth.operator_credential(state_dir)) as writer:
            return renumber.import_records(
                records, agent, IMPORT_CHUNK,
                lambda origin, group: writer.append_many(f"agent/{agent}", group,
                                                         origin=origin).seq)
    finally:
        ctx.destroy(linger=0)


def _session_of(records: list[dict[str, Any]]) -> str | None:
    """The session the adopted records are in (its agent goes on with it)."""
    for record in reversed(records):
        if record.get("event") == "session_started":
            session = (record.get("payload") or {}).get("session")
            return session if isinstance(session, str) else None
    return None


def _spawn(state_dir: StateDir, agent: str, spec: dict[str, Any],
           session: str | None) -> tuple[bool, str]:
    from supervisor.fleet import ctl  # noqa: PLC0415

    model = spec.get("model")
    backend = spec.get("backend")
    if backend == "replay" and spec.get("replay_stream"):
        model = f"replay:{spec['replay_stream']}"
    elif backend == "openai":
        model = f"openai:{model}" if model else "openai"
    elif backend != "scripted":
        model = str(backend)
    else:
        model = None
    request: dict[str, Any] = {"verb": "spawn", "agent": agent,
                               "task": str(spec.get("task", "")), "model": model}
    if session is not None:
        request["session"] = session
    reply = ctl.carry_out(state_dir, request)
    return bool(reply.get("ok")), str(reply.get("detail", ""))


async def adopt_host(js: Any, dead: str, state_dir: StateDir, replicas: int) -> list[Adopted]:
    """Adopt every agent of `dead` that has a bundle (the caller fenced `dead`)."""
    import asyncio  # noqa: PLC0415

    bucket = await objects_bucket(js, replicas)
    names = await _names(bucket)
    agents = sorted({n.split("/")[1] for n in names
                     if n.startswith(f"{dead}/") and n.count("/") == 2
                     and n.endswith("/spec")})
    if not agents:
        return []
    started = time.monotonic()
    ranges = await purges.read_dead(bucket, names, dead)
    records = purges.visible_records(await stream_records(js, dead), ranges)
    done: list[Adopted] = []
    from nats.errors import Error as NatsError  # noqa: PLC0415
    from nats.js.errors import NotFoundError  # noqa: PLC0415

    for agent in agents:
        try:
            spec, pack, extras, gens = await _fetch_bundle(bucket, names, dead, agent)
        except NotFoundError as exc:  # a bundle half uploaded: skip the agent
            log.error("fleet_adopt_bundle_missing", host=dead, agent=agent,
                      error=type(exc).__name__)
            continue
        except (NatsError, TimeoutError, ConnectionError):
            raise  # the cluster still failing after the retries: the round again
        except Exception as exc:  # noqa: BLE001 - a bundle that does not parse: skip it
            log.error("fleet_adopt_bundle_missing", host=dead, agent=agent,
                      error=type(exc).__name__)
            continue
        if not isinstance(spec, dict) or not _valid_name(agent):
            continue
        gens = purges.unpurged_generations(gens, ranges, dead, agent)
        try:
            adopted = await asyncio.get_running_loop().run_in_executor(
                None, adopt_agent, state_dir, dead, agent, spec, pack, records, gens, extras)
        except Exception as exc:  # noqa: BLE001 - a record or pack refused: the next agent
            log.error("fleet_adopt_failed", host=dead, agent=agent,
                      error=f"{type(exc).__name__}: {str(exc)[:200]}")
            done.append(Adopted(agent, None, 0, 0, False, False, type(exc).__name__))
            continue
        log.warning("fleet_agent_adopted", host=dead, agent=agent, tree=adopted.tree,
                    records=adopted.records, dropped=adopted.dropped,
                    tree_behind=adopted.tree_behind, spawned=adopted.spawned,
                    lost=adopted.lost, generation=adopted.generation,
                    detail=adopted.detail, elapsed_ms=round(
                        (time.monotonic() - started) * 1000, 1))
        done.append(adopted)
    return done


def _valid_name(agent: str) -> bool:
    from broker.statedir import NAME_PATTERN  # noqa: PLC0415

    return bool(NAME_PATTERN.fullmatch(agent))
