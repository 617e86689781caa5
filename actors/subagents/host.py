"""The subagents host's work: spawn, watch, build the change set, apply once.

See docs/changesets.md ("The host and the ops").
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict

from actors.changesets import manifest as mf
from actors.changesets import overlay, overlaydiff
from actors.changesets.apply import apply, recover
from actors.changesets.build import build, build_from
from actors.changesets.manifest import Limits
from actors.changesets.snapshot import BaseIndex, snapshot
from actors.kernel.settings import AgentSettings, AgentSpec, Budget, read_spec, write_spec
from actors.kernel.state import BudgetUse
from actors.kernel.workspace import guard_for
from actors.procs import launch
from actors.procs.client import end_session_quietly
from actors.sessions.rebuild import rebuild
from actors.subagents.children import ChildRecord, Children
from actors.subagents.ops import task_path
from actors.subagents.remote import RemoteLink
from actors.subagents.remotepack import PackLimits
from actors.subagents.starter import ChildStarter
from actors.trees import layout, recorder
from actors.trees.statcache import StatCache
from actors.writer.client import WriterClient
from broker import lifeline, protocol
from broker.control import CallWatch
from broker.errors import ChangeSetRefusedError, CorralError
from broker.peer import BrokerPeer
from broker.statedir import StateDir

log = structlog.get_logger("actors.subagents")
ACTOR_NAME = "subagents"
EXIT_STOPPED = 75  # the child agent was stopped with its session open: start it again
MAX_STARTS = 5
SHUTDOWN_TIMEOUT_S = 5.0  # SIGTERM to SIGKILL for the children at shutdown


def remaining(limit: Budget, used: BudgetUse) -> Budget:
    """What is left of `limit` (plus any extra the operator granted) after
    `used`, floored at 0; an unbounded dimension stays unbounded."""
    tokens = None if limit.tokens is None else max(
        0, limit.tokens + used.extra_tokens - used.tokens_used)
    cost = None if limit.cost_units is None else max(
        0.0, limit.cost_units + used.extra_cost - used.cost_used)
    return Budget(tokens=tokens, cost_units=cost)


class SubagentsStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    running_children: int
    spawned_total: int
    ended_total: int
    failed_total: int
    applied_total: int
    refused_total: int
    zygote_forks_total: int  # children forked by the host's zygote
    interpreter_starts_total: int  # children started as fresh interpreters (the fallback)
    zygote_ready: int  # 1 while the host's zygote is up and preloaded
    remote_placed_total: int = 0  # children this host placed on other hosts
    remote_hosted_total: int = 0  # other hosts' children run here
    remote_refused_total: int = 0  # frames of other hosts refused (docs/fleet.md)


@dataclass
class _Deferred:
    sender: str
    ready: Callable[[], bool]
    reply: Callable[[], protocol.Message]
    deadline: float


class SubagentsHost:
    def __init__(self, state: StateDir, peer: BrokerPeer, writer: WriterClient,
                 limits: Limits, *, use_zygote: bool = True,
                 log_args: list[str] | None = None, fleet_host: str | None = None,
                 remote: bool = False, pack_limits: PackLimits | None = None,
                 cow: bool = True) -> None:
        self.state = state
        self.peer = peer
        self.writer = writer
        self.limits = limits
        self.children = Children.load(state.root / "subagents" / "registry.json")
        self.starter = ChildStarter(state, use_zygote=use_zygote, log_args=log_args)
        self._pids: dict[int, ChildRecord] = {}
        self._deferred: list[_Deferred] = []
        self.counts = {"spawned": 0, "ended": 0, "failed": 0, "applied": 0, "refused": 0}
        self.watch: CallWatch | None = None  # the heartbeat, told about blocking appends
        self.remote = RemoteLink(self, fleet_host, remote, pack_limits or PackLimits())
        self.cow = cow and self._cow_probe()  # children's workspaces as overlays
        self.starter.start_zygote()  # it preloads while the host recovers and waits
        self._recover()

    def _cow_probe(self) -> bool:
        """Whether this process can mount a child's workspace as an overlay
        (actors/changesets/overlay.py); else children get a copy."""
        scratch = self.state.root / "subagents" / f"cow-probe-{os.getpid()}"
        scratch.parent.mkdir(parents=True, exist_ok=True)
        reason = overlay.probe(scratch)
        if reason is not None:
            log.info("subagent_cow_unavailable", reason=reason, fallback="copy")
        return reason is None

    # --- facts ----------------------------------------------------------------------
    def record(self, parent: str, event: str, payload: dict[str, Any], key: str) -> None:
        deadline_s = self.writer.timeout_s * (self.writer.retries + 1)
        with self.watch.busy("append", deadline_s) if self.watch else nullcontext():
            self.writer.append(f"subagents/{parent}", event, payload, key=key)

    # --- recovery ---------------------------------------------------------------------
    def _recover(self) -> None:
        for child in self.children.records.values():
            directory = Path(child.directory)
            if child.state == "running" and child.host is None:  # (remote: B runs it)
                try:
                    self._start(child)  # the agent resumes from its stream
                except OSError as exc:
                    if not overlay.is_overlay(directory / "base"):
                        raise
                    # its overlay cannot be mounted again (this host may no longer mount)
                    log.error("subagent_not_resumed", subagent_id=child.subagent_id,
                              error=exc.strerror or str(exc))
                    child.state = "failed"
                    self.counts["failed"] += 1
            elif child.state == "exited":
                self._build(child)
            elif child.state != "running" and overlay.is_overlay(directory / "base"):
                self._unmount(child)  # built before a crash that left it mounted
            if (directory / mf.INTENT).exists():
                seal = self.seal(child)
                if seal is None:
                    log.warning("subagent_apply_unsealed", subagent_id=child.subagent_id)
                    continue
                try:
                    receipt = recover(directory, Path(child.workspace), self._recorder(child),
                                      seal=seal, guard=guard_for(self.state))
                except ChangeSetRefusedError as exc:
                    log.warning("subagent_apply_refused", subagent_id=child.subagent_id,
                                bound=exc.bound)
                    continue
                if receipt is not None:
                    child.state = "applied"
        self.children.save()

    def _recorder(self, child: ChildRecord) -> Callable[[str, dict[str, Any], str], None]:
        return lambda event, payload, key: self.record(child.parent, event, payload, key)

    # --- spawning ---------------------------------------------------------------------
    def spawn(self, message: protocol.SpawnSubagent) -> ChildRecord:
        key = message.key or message.msg_id
        digest = hashlib.sha256(f"{message.parent}\0{key}".encode()).hexdigest()
        subagent_id = f"s-{digest[:12]}"
        existing = self.children.records.get(subagent_id)
        if existing is not None:
            if existing.host is not None and existing.state == "running":
                self.remote.nudge(existing)  # a lost offer or change set: asked again
            return existing
        placed = self.remote.placement(message.host)  # None: here; refused: typed
        workspace = Path(message.workspace)
        if not workspace.is_absolute() or not workspace.is_dir():
            raise ChangeSetRefusedError("invalid_workspace",
                                        f"{message.workspace!r} is not an absolute directory")
        task = task_path(workspace, message.task, self.state)  # the op resolved it; so does this
        parent_spec = read_spec(self.state, message.parent)
        settings = parent_spec.settings if parent_spec is not None else AgentSettings()
        budget = self.remaining_budget(message.parent, settings.budget)
        if budget.tokens == 0 or budget.cost_units == 0:
            raise ChangeSetRefusedError("budget", f"{message.parent} has no budget left "
                                        f"for a child ({budget.model_dump()})")
        directory = self.state.agent_dir(message.parent) / "subagents" / subagent_id
        if directory.exists():
            # a spawn the host died in the middle of (it never recorded the child):
            # its half-made snapshot is redone from the parent's workspace
            log.warning("subagent_snapshot_redone", subagent_id=subagent_id)
            overlay.unmount(directory)
            shutil.rmtree(directory)
        started = time.monotonic()
        name = f"{message.parent}.{subagent_id}"
        index = self._snapshot(workspace, directory, copy=placed is not None)
        log.info("subagent_snapshotted", subagent_id=subagent_id, files=len(index.entries),
                 cow=isinstance(index, overlay.OverlayBase),
                 elapsed_ms=round((time.monotonic() - started) * 1000, 1))
        backend = parent_spec.backend if parent_spec is not None else "scripted"
        if placed is not None:
            return self._place(message, placed, directory, task,
                               settings.model_copy(update={"budget": budget}), backend,
                               len(index.entries))
        if isinstance(index, BaseIndex):
            self._seed_child_cache(name, index)
        else:
            self._seed_from_parent(name, message.parent)
        write_spec(self.state, name, AgentSpec(
            task=task, backend=backend, workspace=str(directory / "work"),
            parent_agent=message.parent,
            settings=settings.model_copy(update={"budget": budget})))
        child = ChildRecord(subagent_id=subagent_id, parent=message.parent, name=name,
                            directory=str(directory), workspace=str(workspace), task=task)
        self.record(child.parent, "subagent_spawned", {
            "subagent_id": subagent_id, "child": name, "descriptor": message.descriptor,
            "task": task, "files": len(index.entries),
        }, f"{subagent_id}:spawned")
        self.children.records[subagent_id] = child
        try:
            self._start(child)
        except BaseException:
            # never recorded as started: a resent spawn redoes it from the snapshot
            del self.children.records[subagent_id]
            raise
        self.counts["spawned"] += 1
        return child

    def _snapshot(self, workspace: Path, directory: Path, *,
                  copy: bool) -> BaseIndex | overlay.OverlayBase:
        """The child's workspace `directory/work`: an overlay of the parent's
        `workspace` where this host can mount one, else a copy (always for a
        child on another host: its snapshot travels as a pack)."""
        if self.cow and not copy:
            try:
                return overlay.prepare(workspace, directory, guard_for(self.state))
            except OSError as exc:
                log.warning("subagent_cow_refused", error=exc.strerror or str(exc),
                            path=exc.filename, fallback="copy")
                overlay.unmount(directory)
                shutil.rmtree(directory)
        return snapshot(workspace, directory / "base", directory / "work",
                        guard_for(self.state))

    def _seed_child_cache(self, name: str, index: BaseIndex) -> None:
        """The child's first capture of its workspace trusts what the snapshot
        hashed as it wrote each copy (a copy whose lstat identity is still the
        one written, outside the racy tick) instead of reading and hashing
        every file again. The stat cache is derived: when it cannot be written
        the child's first capture hashes everything, as it would have."""
        files = {rel: (ident, index.entries[rel].sha256) for rel, ident in index.copies.items()}
        try:
            recorder.seed_stat_cache(self.state, name, files)
        except OSError as exc:
            log.warning("subagent_cache_not_seeded", child=name,
                        error=exc.strerror or type(exc).__name__)

    def _seed_from_parent(self, name: str, parent: str) -> None:
        """An overlaid child sees its parent's files with their lstat
        identities (same inode, size and times): its first capture trusts the
        digests its parent's stat cache trusts for them, and reads the rest."""
        try:
            cache = StatCache.load(layout.stat_cache_path(self.state, parent))
            files = {f"{directory}{leaf}": (ident, digest)
                     for directory, entry in cache.dirs.items()
                     for leaf, (ident, digest) in entry.files.items() if cache.trusted(ident)}
            if files:
                recorder.seed_stat_cache(self.state, name, files)
        except OSError as exc:
            log.warning("subagent_cache_not_seeded", child=name,
                        error=exc.strerror or type(exc).__name__)

    def _place(self, message: protocol.SpawnSubagent, placed: str,  # noqa: PLR0917
               directory: Path, task: str, settings: AgentSettings, backend: str,
               files: int) -> ChildRecord:
        """A child on host `placed` (actors/subagents/remote.py): its snapshot
        goes there; its change set comes back into `directory`."""
        subagent_id = directory.name
        child = ChildRecord(subagent_id=subagent_id, parent=message.parent,
                            name=f"{message.parent}.{subagent_id}", directory=str(directory),
                            workspace=message.workspace, task=task, host=placed)
        self.remote.place(child, settings, backend)
        self.record(child.parent, "subagent_spawned", {
            "subagent_id": subagent_id, "child": child.name, "descriptor": message.descriptor,
            "task": task, "files": files, "host": placed,
        }, f"{subagent_id}:spawned")
        self.children.records[subagent_id] = child
        self.children.save()
        self.counts["spawned"] += 1
        self.remote.nudge(child, force=True)
        return child

    def start_child(self, child: ChildRecord) -> None:
        self._start(child)

    def remaining_budget(self, parent: str, limit: Budget) -> Budget:
        """What is left of `parent`'s bounds now (its stream is folded only when
        it has a bound)."""
        if limit.tokens is None and limit.cost_units is None:
            return limit
        return remaining(limit, rebuild(self.writer, self.state, parent).state.budget)

    def _start(self, child: ChildRecord) -> None:
        begun = time.monotonic()
        if overlay.is_overlay(Path(child.directory) / "base"):
            overlay.ensure_mounted(Path(child.directory))  # (after a host's restart or a reboot)
        started = self.starter.start(child.name, Path(child.directory))
        child.pid, child.state = started.pid, "running"
        child.starts += 1
        self._pids[started.pid] = child
        try:
            self.children.save()  # durable before the gate: a restart knows this child
        except BaseException:
            del self._pids[started.pid]
            started.abandon()  # it exits unrun (reaped as an unknown pid)
            raise
        started.open_gate()
        log.info("subagent_started", subagent_id=child.subagent_id, pid=started.pid,
                 starts=child.starts, via=started.via,
                 elapsed_ms=round((time.monotonic() - begun) * 1000, 1))

    def find(self, parent: str, ref: str) -> ChildRecord | None:
        """A parent's child by id, or its newest with "latest"."""
        if ref == "latest":
            mine = [c for c in self.children.records.values() if c.parent == parent]
            return mine[-1] if mine else None
        return self.children.records.get(ref)

    # --- the loop's chores ------------------------------------------------------------
    def reap(self) -> None:
        for pid, status in lifeline.reap_exited():
            if self.starter.reaped(pid, status):
                continue
            child = self._pids.pop(pid, None)
            if child is None:
                continue
            child.exit_code = os.waitstatus_to_exitcode(status)
            if child.exit_code == EXIT_STOPPED and child.starts < MAX_STARTS:
                self._start(child)
                continue
            child.state = "exited"
            self.children.save()
            self._build(child)

    def _build(self, child: ChildRecord) -> None:
        directory = Path(child.directory)
        # the child's session is over: nothing it started may still write into work/
        end_session_quietly(self.peer, child.name)
        usage = rebuild(self.writer, self.state, child.name).state.budget
        child.tokens_used, child.cost_used = usage.tokens_used, usage.cost_used
        manifest: mf.Manifest | None = None
        seal: mf.Seal | None = None
        if child.exit_code != 0:
            child.state = "failed"
            self.counts["failed"] += 1
        else:
            if not (directory / mf.MANIFEST).exists():
                # sealed from what was built in memory, not from the files
                manifest = self._build_set(child)
                seal = mf.Seal.of(manifest)
            child.state = "ended"
            self.counts["ended"] += 1
        if overlay.is_overlay(directory / "base"):
            self._unmount(child)  # the set holds what the child wrote
        if manifest is None and (directory / mf.MANIFEST).exists():
            data = (directory / mf.MANIFEST).read_bytes()  # built before a host restart
            manifest = mf.Manifest.model_validate_json(data)
            seal = mf.Seal.of(manifest, data)
        self.record(child.parent, "subagent_ended", {
            "subagent_id": child.subagent_id, "exit_code": child.exit_code,
            "status": manifest.status if manifest else None,
            "files": len(manifest.files) if manifest else 0,
            "tokens_used": child.tokens_used, "cost_used": child.cost_used,
            **(seal.as_fact() if seal is not None else {}),
        }, f"{child.subagent_id}:ended")
        self.children.save()
        log.info("subagent_ended", subagent_id=child.subagent_id, exit_code=child.exit_code,
                 status=manifest.status if manifest else None)
        self.remote.ended(child)  # another host's child: its change set goes back

    def _unmount(self, child: ChildRecord) -> None:
        try:
            overlay.unmount(Path(child.directory))
        except OSError as exc:
            log.warning("subagent_cow_unmount_failed", subagent_id=child.subagent_id,
                        error=exc.strerror or str(exc))

    def _build_set(self, child: ChildRecord) -> mf.Manifest:
        directory = Path(child.directory)
        changeset_id = child.remote_id or child.subagent_id  # (the parent host's id)
        task_sha256 = hashlib.sha256(child.task.encode()).hexdigest()
        if not overlay.is_overlay(directory / "base"):
            return build(changeset_id, BaseIndex.load(directory / "base"), directory / "work",
                         directory, limits=self.limits, task_sha256=task_sha256)
        base = overlay.OverlayBase.load(directory / "base")
        overlay.ensure_mounted(directory)
        return build_from(changeset_id, base.digest(),
                          lambda: overlaydiff.diff(base, directory / overlay.UPPER,
                                               directory / "work"),
                          directory, limits=self.limits, task_sha256=task_sha256)

    def settle(self) -> None:
        now = time.monotonic()
        keep = []
        for item in self._deferred:
            if item.ready() or now >= item.deadline:
                self.peer.send(item.sender, item.reply())
            else:
                keep.append(item)
        self._deferred = keep

    def defer(self, sender: str, ready: Callable[[], bool],
              reply: Callable[[], protocol.Message], wait_s: float) -> None:
        self._deferred.append(_Deferred(sender, ready, reply, time.monotonic() + wait_s))

    def next_deadline(self) -> float | None:
        """When the earliest deferred reply is due anyway (None: nothing deferred)."""
        return min((item.deadline for item in self._deferred), default=None)

    # --- replies ----------------------------------------------------------------------
    def reply(self, msg_id: str, child: ChildRecord,
              refusal: str | None = None) -> protocol.SubagentReply:
        directory = Path(child.directory)

        def read(name: str) -> bytes | None:
            try:
                return (directory / name).read_bytes()
            except FileNotFoundError:
                return None

        state = {"exited": "running"}.get(child.state, child.state)
        return protocol.SubagentReply(
            msg_id=msg_id, subagent_id=child.subagent_id, state=state,  # type: ignore[arg-type]
            exit_code=child.exit_code, manifest=read(mf.MANIFEST), patch=read(mf.PATCH),
            receipt=read(mf.RECEIPT), refusal=refusal or child.refusal,
            tokens_used=child.tokens_used,
            cost_used=child.cost_used,
        )

    def seal(self, child: ChildRecord) -> mf.Seal | None:
        """The digests the WAL recorded when `child`'s set was built."""
        for record in self.writer.read_stream(f"subagents/{child.parent}"):
            payload = record.payload() if record.event == "subagent_ended" else None
            if isinstance(payload, dict) and payload.get("subagent_id") == child.subagent_id:
                return mf.Seal.from_fact(payload)
        return None

    def apply(self, msg_id: str, child: ChildRecord) -> protocol.SubagentReply:
        if child.state not in ("ended", "applied"):
            return self.reply(msg_id, child, f"not_ready: the child is {child.state}")
        seal = self.seal(child)
        if seal is None:
            self.counts["refused"] += 1
            return self.reply(msg_id, child, "unsealed: the WAL holds no digests of this set")
        try:
            apply(Path(child.directory), Path(child.workspace), self._recorder(child),
                  seal=seal, guard=guard_for(self.state))
        except ChangeSetRefusedError as exc:
            self.counts["refused"] += 1
            return self.reply(msg_id, child, f"{exc.bound}: {exc.detail}")
        except (OSError, CorralError) as exc:
            return self.reply(msg_id, child, f"failed: {type(exc).__name__}: {exc}")
        child.state = "applied"
        self.counts["applied"] += 1
        self.children.save()
        return self.reply(msg_id, child)

    def statistics(self) -> SubagentsStats:
        return SubagentsStats(
            running_children=sum(1 for c in self.children.records.values()
                                 if c.state == "running"),
            spawned_total=self.counts["spawned"], ended_total=self.counts["ended"],
            failed_total=self.counts["failed"], applied_total=self.counts["applied"],
            refused_total=self.counts["refused"],
            zygote_forks_total=self.starter.counts["zygote"],
            interpreter_starts_total=self.starter.counts["interpreter"],
            zygote_ready=int(self.starter.zygote_ready()),
            remote_placed_total=self.remote.counts["placed"],
            remote_hosted_total=self.remote.counts["hosted"],
            remote_refused_total=self.remote.counts["refused"],
        )

    def shutdown(self, wake_fd: int) -> None:
        """SIGTERM: stop the children (they resume from their streams next time)
        and the zygote; SIGKILL whatever outlives the deadline. `wake_fd` becomes
        readable when a child exits (the loop's SIGCHLD wakeup pipe)."""
        zygote = self.starter.close()  # it exits when its socket closes
        waiting = set(self._pids) | ({zygote} if zygote is not None else set())
        for pid in self._pids:
            launch.end_tree(pid, "-", signal.SIGTERM, sweep=False)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        while waiting:
            waiting -= {pid for pid, _ in lifeline.reap_exited()}
            left_s = deadline - time.monotonic()
            if not waiting or left_s <= 0:
                break
            if select.select([wake_fd], [], [], left_s)[0]:
                os.read(wake_fd, 4096)
        for pid in waiting:
            log.warning("subagent_killed", pid=pid, after_s=SHUTDOWN_TIMEOUT_S)
            launch.end_tree(pid, "-", signal.SIGKILL, sweep=False)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                continue
        self._pids.clear()
        self.children.save()
