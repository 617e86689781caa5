"""A subagent on another host of the fleet: both ends.

See docs/fleet.md ("Subagents on another host").
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import structlog

from actors.changesets import manifest as mf
from actors.changesets.snapshot import BaseIndex, snapshot
from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
from actors.subagents import remotepack
from actors.subagents.children import ChildHost, ChildRecord
from actors.subagents.transfers import Transfers, chunks, materialise, read_task
from broker import protocol, ratelimit
from broker.errors import ChangeSetRefusedError

log = structlog.get_logger("actors.subagents.remote")
_limiter = ratelimit.LogLimiter(log.warning)
ACTOR = "subagents"
OFFER_FILE = "remote-offer.json"  # on A: what the offer carries besides the pack
NUDGE_S = 1.0  # at most one offer or poll per child this often
# the models a child from another host may run on: `replay` and `pipeline` read
# this host's streams and files by name (a replayed stream, a run file), which
# another host must not choose
REMOTE_BACKENDS = frozenset({"scripted", "openai"})


def remote_id(origin: str, subagent_id: str) -> str:
    """The child's id on the host it runs on: from its parent's host and id."""
    return "s-" + hashlib.sha256(f"remote\0{origin}\0{subagent_id}".encode()).hexdigest()[:12]


def remote_label(origin: str, parent: str) -> str:
    """The parent's name on the child's host (never a local agent's)."""
    return "r-" + hashlib.sha256(f"{origin}\0{parent}".encode()).hexdigest()[:12]


def split_sender(sender: str) -> str | None:
    """The host of a `HOST:subagents` sender, None for anyone else."""
    host, sep, name = sender.partition(":")
    return host if sep and name == ACTOR and host else None


class RemoteLink:
    """Both ends of remote children for one subagents actor (see the module
    docstring). `host` None: not in fleet mode; `accept` False: this host
    neither places children elsewhere nor takes other hosts' children."""

    def __init__(self, owner: ChildHost, host: str | None, accept: bool,
                 pack_limits: remotepack.PackLimits) -> None:
        self.owner = owner
        self.host = host
        self.enabled = host is not None and accept
        self.pack_limits = pack_limits
        changeset_max = remotepack.changeset_limits(owner.limits).max_bytes
        self.transfers = Transfers(max(pack_limits.max_bytes, changeset_max) + 64 * 1024)
        self._nudged: dict[str, float] = {}
        self.counts = {"placed": 0, "hosted": 0, "refused": 0}

    # --- placement (the parent's host) ----------------------------------------------
    def placement(self, host: str | None) -> str | None:
        """The remote host a spawn asks for (None: this host), or refused."""
        if host is None or host == self.host:
            return None
        if self.host is None:
            raise ChangeSetRefusedError("remote_off", "not in fleet mode: a child runs here")
        if not self.enabled:
            raise ChangeSetRefusedError("remote_off", "fleet.remote_subagents is off on this "
                                        "host: a child runs here")
        if host == "auto":
            raise ChangeSetRefusedError("placement", "host: auto is not supported; name a host")
        return host

    def place(self, child: ChildRecord, settings: AgentSettings, backend: str) -> None:
        """A new remote child whose snapshot is in its directory: remember what
        the offer carries, and send it."""
        directory = Path(child.directory)
        files, links = remotepack.snapshot_files(BaseIndex.load(directory / "base"))
        total = sum(len(f.data) for f in files)
        if len(files) > self.pack_limits.max_files or total > self.pack_limits.max_bytes:
            raise ChangeSetRefusedError("pack_too_large", f"{len(files)} files, {total} bytes: "
                                        f"over {self.pack_limits.max_files} files or "
                                        f"{self.pack_limits.max_bytes} bytes")
        if backend not in REMOTE_BACKENDS:
            raise ChangeSetRefusedError("backend_refused", f"a {backend} agent's child runs "
                                        "on its own host only")
        task = read_task(Path(child.task))
        child.base_sha256 = remotepack.base_digest(files)
        mf.write_once(directory / OFFER_FILE, json.dumps({
            "task": task.decode("utf-8", "surrogateescape"), "backend": backend,
            "settings": settings.model_dump(mode="json")}).encode())
        shutil.rmtree(directory / "work", ignore_errors=True)  # the child works on B
        log.info("subagent_placed", subagent_id=child.subagent_id, host=child.host,
                 files=len(files), bytes=total, symlinks_left_out=links)
        self.counts["placed"] += 1

    def nudge(self, child: ChildRecord, *, force: bool = False) -> None:
        """Offer again (B has not accepted) or poll (B sends its change set again)."""
        now = time.monotonic()
        if not force and now - self._nudged.get(child.subagent_id, 0.0) < NUDGE_S:
            return
        self._nudged[child.subagent_id] = now
        to = f"{child.host}:{ACTOR}"
        stamp = f"{int(now * 1000) % 10**9}"
        if child.accepted:
            self.owner.peer.send(to, protocol.SubagentRemote(
                msg_id=f"rp-{child.subagent_id}-{stamp}", op="poll",
                subagent_id=child.subagent_id, parent=child.parent))
            return
        directory = Path(child.directory)
        files, _ = remotepack.snapshot_files(BaseIndex.load(directory / "base"))
        blob = remotepack.pack(files)
        offer = json.loads((directory / OFFER_FILE).read_bytes())
        for chunk in chunks(blob):
            self.owner.peer.send(to, chunk)
        self.owner.peer.send(to, protocol.SubagentRemote(
            msg_id=f"ro-{child.subagent_id}-{stamp}", op="offer",
            subagent_id=child.subagent_id, parent=child.parent,
            pack_sha256=remotepack.sha256(blob), pack_bytes=len(blob),
            base_sha256=child.base_sha256, task=offer["task"].encode("utf-8", "surrogateescape"),
            settings=json.dumps(offer["settings"]).encode(), backend=offer["backend"]))

    # --- frames from other hosts ------------------------------------------------------
    def take(self, sender: str, message: protocol.Message) -> bool:
        """Handle a frame of the remote exchange; False: not one."""
        match message:
            case protocol.SubagentChunk():
                origin = split_sender(sender)
                if origin is None or not self.enabled:
                    self._refused(sender, "chunk from a sender that is not a subagents host")
                elif (why := self.transfers.add(origin, message)) is not None:
                    self._refused(sender, why)
                return True
            case protocol.SubagentRemote():
                self.owner.peer.send(sender, self._serve(sender, message))
                return True
            case protocol.SubagentRemoteReply():
                self._answered(sender, message)
                return True
            case protocol.Error(msg_id=msg_id) if msg_id is not None and \
                    msg_id.startswith(("ro-s-", "rp-s-")):
                self._failed_send(sender, message)
                return True
        return False

    def _refused(self, sender: str, why: str) -> None:
        self.counts["refused"] += 1
        if _limiter.allow():
            log.warning("subagent_remote_refused", sender=sender[:140], reason=why[:300],
                        refused_total=self.counts["refused"])

    # --- the child's host (B) -----------------------------------------------------------
    def _serve(self, sender: str, message: protocol.SubagentRemote) -> protocol.Message:
        origin = split_sender(sender)
        if origin is None or not self.enabled or origin == self.host:
            self._refused(sender, "offer from a sender that is not another host's subagents, "
                          "or remote subagents are off here")
            return protocol.Error(msg_id=message.msg_id, code=protocol.ErrorCode.FORBIDDEN,
                                  detail=f"host {self.host} takes no subagents from {sender}"
                                  " (fleet.remote_subagents off, or not a subagents host)")
        local = remote_id(origin, message.subagent_id)
        child = self.owner.children.records.get(local)
        if child is not None:
            if child.origin != origin or child.remote_id != message.subagent_id:
                self._refused(sender, "names another host's child")
                return protocol.Error(msg_id=message.msg_id, code=protocol.ErrorCode.FORBIDDEN,
                                      detail="not your child")
            return self.result(child, message.msg_id)
        if message.op == "poll":
            return self._reply(message, "failed", "not_found: no such child on this host")
        try:
            child = self._host_child(origin, message)
        except ChangeSetRefusedError as exc:
            self._refused(sender, str(exc))
            return self._reply(message, "refused", f"{exc.bound}: {exc.detail}"[:2000])
        if child is None:
            return self._reply(message, "incomplete", "the pack's chunks did not all arrive")
        return self._reply(message, "running")

    @staticmethod
    def _reply(message: protocol.SubagentRemote, state: str,
               refusal: str | None = None) -> protocol.SubagentRemoteReply:
        return protocol.SubagentRemoteReply(msg_id=message.msg_id,
                                            subagent_id=message.subagent_id,
                                            state=state, refusal=refusal)  # type: ignore[arg-type]

    def _host_child(self, origin: str, message: protocol.SubagentRemote) -> ChildRecord | None:
        if message.pack_sha256 is None or message.base_sha256 is None or message.task is None \
                or message.settings is None:
            raise ChangeSetRefusedError("malformed_offer", "an offer without pack, base, task "
                                        "or settings")
        if message.backend not in REMOTE_BACKENDS:
            raise ChangeSetRefusedError("backend_refused", f"backend {message.backend}: a child "
                                        "from another host runs on scripted or openai only")
        blob = self.transfers.take(origin, message.pack_sha256)
        if blob is None:
            return None
        files = remotepack.unpack(blob, message.pack_sha256, self.pack_limits)
        if remotepack.base_digest(files) != message.base_sha256:
            raise ChangeSetRefusedError("digest_mismatch", "the files are not the base named")
        try:
            settings = AgentSettings.model_validate_json(message.settings)
        except ValueError as exc:
            raise ChangeSetRefusedError("malformed_offer", "settings do not parse") from exc
        owner = self.owner
        label = remote_label(origin, message.parent)
        local = remote_id(origin, message.subagent_id)
        directory = owner.state.agent_dir(label) / "subagents" / local
        if directory.exists():
            shutil.rmtree(directory)  # a half-made one (the host died before recording it)
        incoming = directory / "incoming"
        materialise(incoming, files)
        index = snapshot(incoming, directory / "base", directory / "work")
        shutil.rmtree(incoming)
        if index.digest() != message.base_sha256:
            raise ChangeSetRefusedError("digest_mismatch", "the materialised base differs")
        task = directory / "task.yaml"
        mf.write_once(task, message.task)
        name = f"{label}.{local}"
        write_spec(owner.state, name, AgentSpec(
            task=str(task), backend=message.backend, workspace=str(directory / "work"),
            parent_agent=label, settings=settings))
        child = ChildRecord(subagent_id=local, parent=label, name=name,
                            directory=str(directory), workspace=str(directory / "work"),
                            task=str(task), origin=origin, remote_id=message.subagent_id)
        owner.record(label, "subagent_spawned", {
            "subagent_id": local, "child": name, "descriptor": "remote", "task": str(task),
            "files": len(files), "origin": origin, "origin_id": message.subagent_id,
        }, f"{local}:spawned")
        owner.children.records[local] = child
        try:
            owner.start_child(child)
        except BaseException:
            del owner.children.records[local]
            raise
        owner.counts["spawned"] += 1
        self.counts["hosted"] += 1
        log.info("subagent_hosted", subagent_id=local, origin=origin,
                 origin_id=message.subagent_id, files=len(files))
        return child

    def result(self, child: ChildRecord, msg_id: str | None = None) -> protocol.Message:
        """The child's state for its parent's host; once it ended, its change set's
        pack goes ahead in chunks."""
        assert child.origin is not None
        assert child.remote_id is not None
        state = {"exited": "running", "applied": "ended"}.get(child.state, child.state)
        reply_id = msg_id or f"rr-{child.remote_id}"
        pack = None
        directory = Path(child.directory)
        if state == "ended" and (directory / mf.MANIFEST).exists():
            manifest = mf.load(directory)
            patch = (directory / mf.PATCH).read_bytes() if manifest.status == "ready" else None
            blobs = {c.after_sha256: (directory / mf.BLOBS / c.after_sha256).read_bytes()
                     for c in manifest.files if c.after_sha256 is not None} \
                if manifest.status == "ready" else {}
            pack = remotepack.pack(remotepack.changeset_files(
                (directory / mf.MANIFEST).read_bytes(), patch, blobs))
            for chunk in chunks(pack):
                self.owner.peer.send(f"{child.origin}:{ACTOR}", chunk)
        return protocol.SubagentRemoteReply(
            msg_id=reply_id, subagent_id=child.remote_id, state=state,  # type: ignore[arg-type]
            exit_code=child.exit_code, pack_sha256=remotepack.sha256(pack) if pack else None,
            pack_bytes=len(pack) if pack else 0, tokens_used=child.tokens_used,
            cost_used=child.cost_used)

    def ended(self, child: ChildRecord) -> None:
        """A hosted child ended (its set built): tell its parent's host."""
        if child.origin is not None:
            self.owner.peer.send(f"{child.origin}:{ACTOR}", self.result(child))

    # --- the parent's host (A) ------------------------------------------------------------
    def _asked(self, sender: str, subagent_id: str) -> ChildRecord | None:
        child = self.owner.children.records.get(subagent_id)
        origin = split_sender(sender)
        if child is None or child.host is None or origin != child.host:
            self._refused(sender, f"a reply for {subagent_id} from a host that was not asked")
            return None
        return child

    def _answered(self, sender: str, message: protocol.SubagentRemoteReply) -> None:
        child = self._asked(sender, message.subagent_id)
        if child is None or child.state != "running":
            return
        if message.state == "running":
            if not child.accepted:
                child.accepted = True
                self.owner.children.save()
        elif message.state == "incomplete":
            self.nudge(child, force=True)
        elif message.state in ("refused", "failed") or message.pack_sha256 is None:
            self._fail(child, message.refusal or f"the child {message.state} on {child.host}",
                       message.exit_code, message)
        else:
            self._collect(sender, child, message)

    def _collect(self, sender: str, child: ChildRecord,
                 message: protocol.SubagentRemoteReply) -> None:
        assert child.host is not None
        assert message.pack_sha256 is not None
        blob = self.transfers.take(child.host, message.pack_sha256)
        if blob is None:
            return  # chunks lost: the next poll has them sent again
        directory = Path(child.directory)
        base = BaseIndex.load(directory / "base")
        try:
            verified = remotepack.verify_changeset(
                blob, message.pack_sha256, changeset_id=child.subagent_id,
                base={p: (e.sha256, e.mode) for p, e in base.entries.items()},
                base_sha256=str(child.base_sha256), limits=self.owner.limits)
        except ChangeSetRefusedError as exc:
            child.refusal = f"{exc.bound}: {exc.detail}"[:2000]
            self._refused(sender, f"change set of {child.subagent_id}: {child.refusal}")
            return
        (directory / mf.BLOBS).mkdir(exist_ok=True)
        for name, data in verified.blobs.items():
            mf.write_once(directory / mf.BLOBS / name, data)
        if verified.patch is not None:
            mf.write_once(directory / mf.PATCH, verified.patch)
        mf.write_once(directory / mf.MANIFEST, verified.manifest_bytes)  # last: complete
        child.exit_code = message.exit_code
        child.tokens_used, child.cost_used = clamp_usage(directory, message.tokens_used,
                                                         message.cost_used)
        child.state, child.refusal = "ended", None
        self.owner.counts["ended"] += 1
        self._ended_fact(child, mf.Seal.of(verified.manifest, verified.manifest_bytes),
                         verified.manifest)
        log.info("subagent_collected", subagent_id=child.subagent_id, host=child.host,
                 status=verified.manifest.status, files=len(verified.manifest.files))

    def _fail(self, child: ChildRecord, refusal: str, exit_code: int | None,
              message: protocol.SubagentRemoteReply | None = None) -> None:
        child.state, child.refusal, child.exit_code = "failed", refusal[:2000], exit_code
        if message is not None:
            child.tokens_used, child.cost_used = clamp_usage(
                Path(child.directory), message.tokens_used, message.cost_used)
        self.owner.counts["failed"] += 1
        self._ended_fact(child, None, None)
        log.warning("subagent_remote_failed", subagent_id=child.subagent_id, host=child.host,
                    refusal=child.refusal[:300])

    def _ended_fact(self, child: ChildRecord, seal: mf.Seal | None,
                    manifest: mf.Manifest | None) -> None:
        self.owner.record(child.parent, "subagent_ended", {
            "subagent_id": child.subagent_id, "exit_code": child.exit_code,
            "status": manifest.status if manifest else None,
            "files": len(manifest.files) if manifest else 0,
            "tokens_used": child.tokens_used, "cost_used": child.cost_used,
            "host": child.host, "refusal": child.refusal,
            **(seal.as_fact() if seal is not None else {}),
        }, f"{child.subagent_id}:ended")
        self.owner.children.save()

    def _failed_send(self, sender: str, error: protocol.Error) -> None:
        """An error for an offer or poll: from the local broker (the bridge: the
        host is dead, silent or unknown) or from the child's host."""
        subagent_id = str(error.msg_id)[3:17]
        child = self.owner.children.records.get(subagent_id)
        if child is None or child.host is None or child.state != "running" or \
                sender not in ("broker", f"{child.host}:{ACTOR}"):
            self._refused(sender, f"an error for {subagent_id} from a host that was not asked")
            return
        code, detail = error.code, error.detail
        gone = code is protocol.ErrorCode.HOST_UNREACHABLE and (
            "declared dead" in detail or "no such host" in detail)
        if gone or (str(error.msg_id).startswith("ro-") and code in (
                protocol.ErrorCode.FORBIDDEN, protocol.ErrorCode.INVALID_MESSAGE,
                protocol.ErrorCode.FRAME_TOO_LARGE, protocol.ErrorCode.MALFORMED_FRAME)):
            # (malformed: this broker has no bridge, so HOST:NAME is no name to it)
            self._fail(child, f"{code.value}: {detail}", None)


def clamp_usage(directory: Path, tokens: int, cost: float) -> tuple[int, float]:
    """The usage another host reports, at most the budget the child was given
    (a host cannot charge a parent more than it sent)."""
    try:
        budget = json.loads((directory / OFFER_FILE).read_bytes())["settings"]["budget"]
    except (OSError, ValueError, KeyError, TypeError):
        return tokens, cost
    limit_tokens, limit_cost = budget.get("tokens"), budget.get("cost_units")
    return (tokens if limit_tokens is None else min(tokens, int(limit_tokens)),
            cost if limit_cost is None else min(cost, float(limit_cost)))
