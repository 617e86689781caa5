"""The procs loop: requests, terminal pumps, reaping, caps, deferred replies.

The loop never blocks on a program; jobs are named from (session, msg_id).
See docs/procs.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from pydantic import BaseModel, ConfigDict

from actors.kernel.settings import read_spec, workspace_for
from actors.procs import cgroup, grants, launch, ownership, sandbox
from actors.procs.command import Command, read_exit_file, wrapper_argv
from actors.procs.facts import Facts, sha256
from actors.procs.job import GROUP_KEY, SANDBOX_KEY, Job
from actors.procs.mcpbridge import McpBridge
from actors.procs.quota import WorkspaceQuota
from actors.procs.registry import Entry, JobKind, Registry, read_end_file, write_end_file
from actors.procs.terminal import DISK_FULL_ERRNOS, Terminal
from broker import lifeline, protocol
from broker.control import ControlReporter
from broker.errors import ConfigError
from broker.peer import BrokerPeer
from broker.statedir import StateDir

log = structlog.get_logger("actors.procs")
ACTOR_NAME = "procs"
SETTLE_MARGIN_S = 5.0  # after the grace period, how long a kill reply may wait
TERMINAL_TERM = "xterm"


@dataclass(frozen=True)
class HostOptions:
    kill_grace_s: float = 1.0
    command_cap_bytes: int = 64 * 1024 * 1024
    terminal_cap_bytes: int = 16 * 1024 * 1024
    command_lifetime_s: float = 3600.0
    terminal_lifetime_s: float = 1800.0
    tick_s: float = 0.02
    heartbeat_interval_s: float = 1.0
    sandbox: sandbox.SandboxPolicy = field(default_factory=sandbox.SandboxPolicy)
    limits: cgroup.Limits = field(default_factory=cgroup.Limits)


class ProcsStats(BaseModel):
    """Counters shown by `supervisor status` (heartbeat values)."""

    model_config = ConfigDict(frozen=True)

    live_commands: int
    live_terminals: int
    started_total: int
    ended_total: int
    killed_total: int
    capped_total: int
    expired_total: int
    lost_total: int
    reattached_total: int
    requests_total: int
    refused_total: int
    log_disk_full: int = 0  # terminals whose log the full disk does not take now
    registry_disk_full: int = 0  # 1 while the registry cannot be saved (full disk)


@dataclass
class _Deferred:
    sender: str
    msg_id: str
    ready: Callable[[], bool]
    reply: Callable[[], protocol.Message]
    deadline: float  # monotonic; the reply is sent then whatever the state
    on_due: Callable[[], None] | None = None  # called once at the deadline (timeout kill)


@dataclass
class Counters:
    started: int = 0
    ended: int = 0
    reattached: int = 0
    requests: int = 0
    refused: int = 0
    by_state: dict[str, int] = field(default_factory=dict)


def session_dir(state: StateDir, session: str) -> str:
    """Where a session's files live: `.corral/agents/<session>/` (docs/procs.md)."""
    return str(state.agent_dir(session))


def new_proc_id(kind: JobKind, session: str, msg_id: str) -> str:
    digest = hashlib.sha256(f"{session}\0{msg_id}".encode()).hexdigest()[:16]
    return f"{'p' if kind == 'command' else 't'}-{digest}"


class RefusedError(Exception):
    def __init__(self, code: protocol.ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class ProcsHost:
    def __init__(
        self, state: StateDir, peer: BrokerPeer, facts: Facts, options: HostOptions,
        reporter: ControlReporter | None = None,
    ) -> None:
        self.state = state
        launch.scope_markers(str(state.root))  # another runtime's same-named jobs are not ours
        self.peer = peer
        self.facts = facts
        self.options = options
        self.reporter = reporter
        self.registry = Registry.load(state.root / "procs" / "registry.json")
        self.jobs: dict[str, Job] = {}
        self._by_pid: dict[int, Job] = {}
        self._deferred: list[_Deferred] = []
        self.counters = Counters()
        self.mcp = McpBridge(self)  # MCP servers, one instance per sender (mcpbridge.py)
        self.mcp.warm()
        self.sandbox_error: str | None = None
        self.logs_full: set[str] = set()  # terminals whose log the full disk refused
        self.registry_full: str | None = None
        self.layout: cgroup.Layout | None = None
        self._dead_groups: dict[str, cgroup.Group] = {}  # killed, their directories not yet removed
        self._check_sandbox()
        self._check_groups()
        lifeline.become_subreaper()
        self._recover()
        self._end_orphan_groups()

    def _check_sandbox(self) -> None:
        policy = self.options.sandbox
        if not policy.enabled:
            log.warning("sandbox_off", detail="commands and terminals run unconfined "
                        "(configuration sandbox.mode: off)")
            return
        try:
            self.options = dataclasses.replace(
                self.options, sandbox=sandbox.check(policy, str(self.state.root)))
        except sandbox.SandboxUnavailableError as exc:
            self.sandbox_error = str(exc)
            log.error("sandbox_unavailable", error=self.sandbox_error)

    def _check_groups(self) -> None:
        """Find where job groups go; without any, refuse jobs unless the
        configuration said so (`sandbox.cgroups: off`, or the sandbox off)."""
        policy = self.options.sandbox
        self.layout = cgroup.probe(launch.runtime_scope(str(self.state.root)))
        if self.layout is not None:
            log.info("cgroups_found", kill=self.layout.kill, freezer=self.layout.freezer,
                     limits=sorted(self.layout.limits))
            return
        if policy.enabled and policy.cgroups and self.sandbox_error is None:
            self.sandbox_error = (
                "no usable control group hierarchy (cgroup v2 with cgroup.kill, or v1 "
                "freezer) to hold each command: jobs could outlive their end; set "
                "`sandbox: {cgroups: off}` in the configuration to run commands without")
            log.error("sandbox_unavailable", error=self.sandbox_error)
        else:
            log.warning("cgroups_off", detail="commands run without a control group: "
                        "no per-job limits, ended by their process group and markers")

    def _group_of(self, entry: Entry) -> cgroup.Group | None:
        if self.layout is None or entry.extra.get(GROUP_KEY) != "on":
            return None
        return cgroup.Group(entry.proc_id, self.layout)

    def _end_orphan_groups(self) -> None:
        """Kill the groups a previous run left that no running job claims."""
        if self.layout is None:
            return
        keep = {j.proc_id for j in self.jobs.values() if j.running and j.cgroup is not None}
        for name in cgroup.end_orphans(self.layout, keep):
            log.warning("orphan_group_killed", group=name)
            self._dead_groups[name] = cgroup.Group(name, self.layout)

    def _bury(self, job: Job) -> None:
        """The job ended: kill what is left of its group (a daemon that left
        the sandbox's reach), its directories removed once empty."""
        if job.cgroup is not None:
            cgroup.kill(job.cgroup)
            self._dead_groups[job.proc_id] = job.cgroup

    def _remove_dead_groups(self) -> None:
        """Remove the ended groups now empty; the runtime's base directories
        too once no group is left (made again by the next job's)."""
        removed = False
        for name, group in list(self._dead_groups.items()):
            if cgroup.remove(group):
                del self._dead_groups[name]
                removed = True
        if (removed and self.layout is not None and not self._dead_groups
                and not any(j.running and j.cgroup is not None for j in self.jobs.values())):
            cgroup.release(self.layout)

    # --- recovery after a crash of procs ------------------------------------------
    def _recover(self) -> None:
        grace = self.options.kill_grace_s
        for entry in list(self.registry.entries.values()):
            job: Job
            if entry.kind == "terminal":
                job = Terminal(entry, None, kill_grace_s=grace)
            else:
                job = Command(entry, ours=False, kill_grace_s=grace)
            self.jobs[entry.proc_id] = job
            if entry.state != "running":
                continue
            job.cgroup = self._group_of(entry)
            if entry.kind == "command" and launch.alive(entry.pid, entry.start_ticks):
                self.counters.reattached += 1
                self.facts.record(entry.session, "proc_reattached",
                                  f"{entry.proc_id}:reattach:{os.getpid()}",
                                  proc_id=entry.proc_id, pid=entry.pid)
                log.info("proc_reattached", proc_id=entry.proc_id, pid=entry.pid)
                continue
            code = read_exit_file(entry.exit_path)
            if entry.kind == "command" and code is not None:
                entry.state, entry.exit_code = "exited", code
                self._ended(job)
                continue
            if job.cgroup is not None:
                self._bury(job)
            # SIGKILL what is left: the group only while its recorded leader lives (a
            # gone leader's pid may since lead someone else's group); the marker
            # sweep finds the descendants either way
            launch.end_tree(entry.pid, entry.proc_id, signal.SIGKILL,
                            group=launch.alive(entry.pid, entry.start_ticks)
                            or launch.group_is_ours(entry.pid, entry.proc_id, job.sandboxed),
                            sandboxed=job.sandboxed)
            entry.state = "lost"
            self.facts.record(entry.session, "proc_lost", f"{entry.proc_id}:lost",
                              proc_id=entry.proc_id, kind=entry.kind,
                              reason="terminal master died with procs" if entry.kind == "terminal"
                              else "gone without an exit status")
            log.warning("proc_lost", proc_id=entry.proc_id, kind=entry.kind, pid=entry.pid)
            self._count_end(job)
            self.registry.ended(entry.proc_id)
            write_end_file(entry)
        self.registry.save()

    # --- starting -----------------------------------------------------------------
    def _files(self, session: str, kind: JobKind, proc_id: str) -> tuple[str, str]:
        sub = ".procs" if kind == "command" else ".terminals"
        directory = os.path.join(session_dir(self.state, session), sub)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return os.path.join(directory, f"{proc_id}.log"), os.path.join(directory, f"{proc_id}.exit")

    def remember(self, session: str, kind: JobKind, proc_id: str) -> Job | None:
        """A job of `session` whose entry the registry let go (it keeps only the
        newest ended ones, and a restart of procs starts from it): its log is
        still on disk (created before the job could run). It is answered from
        its files, exited with the status its exit file holds or else lost;
        a start resent for it never runs it again. None: no such job."""
        log_path, exit_path = self._files(session, kind, proc_id)
        if not os.path.exists(log_path):
            return None
        entry = Entry(proc_id=proc_id, kind=kind, session=session, pid=0, start_ticks=0,
                      log_path=log_path, exit_path=exit_path if kind == "command" else None,
                      cap_bytes=os.path.getsize(log_path), deadline_wall=0.0, state="lost")
        ending = read_end_file(log_path)
        code = read_exit_file(exit_path) if kind == "command" else None
        if ending is not None:
            entry.state, entry.exit_code, entry.kill_reason = ending
        elif code is not None:
            entry.state, entry.exit_code = "exited", code
        grace = self.options.kill_grace_s
        job: Job = (Command(entry, ours=False, kill_grace_s=grace) if kind == "command"
                    else Terminal(entry, None, kill_grace_s=grace))
        self.jobs[proc_id] = job
        self.registry.entries[proc_id] = entry
        self.registry.dirty = True
        log.info("proc_remembered", proc_id=proc_id, state=entry.state,
                 exit_code=entry.exit_code)
        return job

    def _check_cwd(self, cwd: str) -> None:
        if not os.path.isabs(cwd) or not os.path.isdir(cwd):
            raise RefusedError(protocol.ErrorCode.INVALID_MESSAGE,
                               f"cwd {cwd!r} is not an absolute path to a directory")

    def workspace_of(self, session: str) -> str:
        """The session's workspace (real path): its spec's, or the default; a
        pipeline runner without a spec of its own has its agent's
        (ownership.owner_of)."""
        try:
            spec = read_spec(self.state, session)
            if spec is None and (owner := ownership.owner_of(session)) != session:
                session, spec = owner, read_spec(self.state, owner)
        except ConfigError as exc:
            raise RefusedError(protocol.ErrorCode.INVALID_MESSAGE, str(exc)) from exc
        path = (workspace_for(self.state, session, spec) if spec is not None
                else self.state.agent_dir(session) / "workspace")
        return os.path.realpath(path)

    def confinement(self, session: str, cwd: str) -> sandbox.Confinement:
        """Where a job of `session` may write; refuses a cwd outside it (and a
        missing sandbox, unless the policy turned it off)."""
        if self.sandbox_error is not None:
            raise RefusedError(protocol.ErrorCode.SANDBOX_UNAVAILABLE, self.sandbox_error)
        self._check_cwd(cwd)
        workspace = self.workspace_of(session)
        real = os.path.realpath(cwd)
        if workspace == "/" or not os.path.isdir(workspace) or (
                real != workspace and not real.startswith(workspace + "/")):
            raise RefusedError(protocol.ErrorCode.INVALID_MESSAGE,
                               f"cwd {cwd!r} is not inside the workspace of session {session}")
        policy = self.options.sandbox
        hidden, masked = sandbox.split_hidden((str(self.state.root), *policy.hide), workspace)
        mask = sandbox.mask_file(str(self.state.run_dir)) if masked else ""
        return sandbox.Confinement(workspace=workspace, hidden=hidden, masked=masked, mask=mask,
                                   network=self._network(session))

    def _network(self, session: str) -> bool:
        """Whether the session's commands get the network: the operator's
        `sandbox.network` matched against the operator-created agent whose
        grants the session holds (actors/procs/grants.py), never against a
        name an agent picked (a schedule's run holds its owner's grants)."""
        holder = grants.holder(self.state, session)
        return holder is not None and self.options.sandbox.network_for(holder)

    def start_command(
        self, session: str, msg_id: str, command: str, *, cwd: str, cap: int | None,
        lifetime_s: float | None, foreground: bool,
    ) -> Job:
        proc_id = new_proc_id("command", session, msg_id)
        known = self.jobs.get(proc_id) or self.remember(session, "command", proc_id)
        if known is not None:
            return known
        confinement = self.confinement(session, cwd)
        cap_bytes = cap or self.options.command_cap_bytes
        lifetime = lifetime_s or self.options.command_lifetime_s
        log_path, exit_path = self._files(session, "command", proc_id)
        open(log_path, "ab").close()
        quota = self._quota(confinement)
        group = self._new_group(proc_id)
        filter_fd = sandbox.seccomp_fd(self.options.sandbox)
        try:
            prefix = self.argv_prefix(confinement, cwd, sandbox.clean_env(os.environ), proc_id,
                                  filter_fd)
            spawned = launch.spawn(wrapper_argv(command, log_path, cap_bytes, exit_path, prefix),
                                   launch.job_env(os.environ, proc_id), cwd,
                                   pass_fds=() if filter_fd is None else (filter_fd,))
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
        self._join(group, spawned)
        entry = self._entry(proc_id, "command", session, spawned.pid, log_path=log_path,
                            exit_path=exit_path, cap_bytes=cap_bytes, lifetime_s=lifetime)
        job = Command(entry, ours=True, kill_grace_s=self.options.kill_grace_s)
        job.cgroup = group
        job.quota = quota
        self._launch(job, spawned)
        self.facts.record(session, "proc_start", f"{proc_id}:start", proc_id=proc_id,
                          pid=entry.pid, command_sha256=sha256(command.encode()),
                          command_bytes=len(command.encode()), cwd=cwd, cap_bytes=cap_bytes,
                          lifetime_s=lifetime, foreground=foreground)
        return job

    def start_terminal(self, message: protocol.TerminalStart) -> Job:
        proc_id = new_proc_id("terminal", message.session, message.msg_id)
        known = self.jobs.get(proc_id) or self.remember(message.session, "terminal", proc_id)
        if known is not None:
            return known
        confinement = self.confinement(message.session, message.cwd)
        cap_bytes = message.max_output_bytes or self.options.terminal_cap_bytes
        lifetime = message.lifetime_s or self.options.terminal_lifetime_s
        log_path, _ = self._files(message.session, "terminal", proc_id)
        filter_fd = sandbox.seccomp_fd(self.options.sandbox)
        try:
            prefix = self.argv_prefix(confinement, message.cwd,
                                  sandbox.clean_env(os.environ, term=TERMINAL_TERM), proc_id,
                                  filter_fd)
        except BaseException:
            if filter_fd is not None:
                os.close(filter_fd)
            raise
        # sandboxed, bwrap starts with nothing in its environment (found by its
        # hostname); unconfined, `env -i` is the leader and carries the marker
        outer = {} if self.options.sandbox.enabled else launch.job_env(os.environ, proc_id)
        try:
            group = self._new_group(proc_id)
            master, slave = launch.open_pty(message.rows, message.cols)
            try:
                spawned = launch.spawn([*prefix, *message.argv], outer, message.cwd,
                                       stdio_fd=slave, controlling_tty=True, die_with_parent=True,
                                       pass_fds=() if filter_fd is None else (filter_fd,))
            finally:
                os.close(slave)  # only the child holds the slave: its close gives us EIO
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
        try:
            self._join(group, spawned)
        except RefusedError:
            os.close(master)
            raise
        entry = self._entry(proc_id, "terminal", message.session, spawned.pid,
                            log_path=log_path, exit_path=None, cap_bytes=cap_bytes,
                            lifetime_s=lifetime)
        job = Terminal(entry, master, kill_grace_s=self.options.kill_grace_s)
        job.cgroup = group
        job.quota = self._quota(confinement)
        self._launch(job, spawned)
        argv_bytes = "\0".join(message.argv).encode()
        self.facts.record(message.session, "terminal_start", f"{proc_id}:start",
                          proc_id=proc_id, pid=entry.pid, argv_sha256=sha256(argv_bytes),
                          argv_bytes=len(argv_bytes), cwd=message.cwd, cap_bytes=cap_bytes,
                          lifetime_s=lifetime)
        return job

    def argv_prefix(self, confinement: sandbox.Confinement, cwd: str, env: dict[str, str],
                proc_id: str, filter_fd: int | None = None) -> list[str]:
        """The program's argv prefix. Sandboxed, its environment is exactly the
        clean one (the sandbox is found by its hostname); unconfined, it keeps
        the job marker, which is then how its escaped descendants are found."""
        policy = self.options.sandbox
        inner = env if policy.enabled else launch.job_env(env, proc_id)
        return sandbox.prefix(policy, confinement, cwd, inner, launch.marker(proc_id),
                              seccomp=filter_fd)

    def _quota(self, confinement: sandbox.Confinement) -> WorkspaceQuota | None:
        """The job's workspace quota, its base measured now (before it runs)."""
        limit = self.options.limits.workspace_bytes
        return WorkspaceQuota.start(confinement.workspace, limit) if limit > 0 else None

    def _new_group(self, proc_id: str) -> cgroup.Group | None:
        """The job's control group with its limits, made before anything runs."""
        if self.layout is None:
            return None
        self._dead_groups.pop(proc_id, None)
        try:
            return cgroup.create(self.layout, proc_id, self.options.limits)
        except cgroup.CgroupError as exc:
            log.error("cgroup_failed", proc_id=proc_id, error=str(exc))
            raise RefusedError(protocol.ErrorCode.SANDBOX_UNAVAILABLE, str(exc)) from exc

    def _join(self, group: cgroup.Group | None, spawned: launch.Spawned) -> None:
        """The child, parked at its start gate, joins the group: whatever it
        forks from then on is inside."""
        if group is None:
            return
        try:
            cgroup.join(group, spawned.pid)
        except cgroup.CgroupError as exc:
            launch.abandon(spawned)
            cgroup.kill(group)
            self._dead_groups[group.name] = group
            log.error("cgroup_failed", proc_id=group.name, error=str(exc))
            raise RefusedError(protocol.ErrorCode.SANDBOX_UNAVAILABLE, str(exc)) from exc

    def _entry(self, proc_id: str, kind: JobKind, session: str, pid: int, *, log_path: str,
               exit_path: str | None, cap_bytes: int, lifetime_s: float) -> Entry:
        # the child is parked at its start gate, so its start time is readable
        ticks = launch.start_ticks(pid) or 0
        return Entry(proc_id=proc_id, kind=kind, session=session, pid=pid, start_ticks=ticks,
                     log_path=log_path, exit_path=exit_path, cap_bytes=cap_bytes,
                     deadline_wall=time.time() + lifetime_s,
                     extra={SANDBOX_KEY: "on" if self.options.sandbox.enabled else "off",
                            GROUP_KEY: "on" if self.layout is not None else "off"})

    def _launch(self, job: Job, spawned: launch.Spawned) -> None:
        """Registry first (durable), then the gate: no unnamed process can run."""
        self.jobs[job.proc_id] = job
        self._by_pid[spawned.pid] = job
        self.registry.put(job.entry)
        try:
            self.registry.save()
        except OSError:
            # never ran: forget it whole, so the same request retried later
            # (after a full disk, say) starts it instead of finding a lost job
            launch.abandon(spawned)
            if job.cgroup is not None:
                self._dead_groups[job.proc_id] = job.cgroup
            self.jobs.pop(job.proc_id, None)
            self._by_pid.pop(spawned.pid, None)
            self.registry.drop(job.proc_id)
            if isinstance(job, Terminal):
                job.close_fds()
            with contextlib.suppress(OSError):
                os.unlink(job.entry.log_path)
            raise
        failed = launch.open_gate(spawned)
        self.counters.started += 1
        log.info("proc_started", proc_id=job.proc_id, kind=job.entry.kind, pid=spawned.pid,
                 session=job.entry.session, exec_errno=failed)

    # --- the loop's chores -------------------------------------------------------
    def reap(self) -> None:
        for pid, status in lifeline.reap_exited():
            job = self._by_pid.pop(pid, None)
            if job is not None:
                job.wait_status = status

    def refresh(self) -> None:
        for job in list(self.jobs.values()):
            if isinstance(job, Terminal) and job.running:
                job.pump()
            if job.running:
                if job.refresh():
                    self._ended(job)
            elif job.kill_deadline is not None:
                job.escalate()
        now = time.monotonic()
        still: list[_Deferred] = []
        for item in self._deferred:
            if not item.ready() and now < item.deadline:
                still.append(item)
                continue
            if not item.ready() and item.on_due is not None:
                due, item.on_due = item.on_due, None
                due()  # e.g. the foreground timeout: kill, then wait for the end
                item.deadline = now + self.options.kill_grace_s + SETTLE_MARGIN_S
                still.append(item)
                continue
            self.peer.send(item.sender, item.reply())
        self._deferred = still
        self._note_disk_full()
        self._remove_dead_groups()
        saves = self.registry.saves
        try:
            self.registry.save()
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            # stays dirty: saved at a later turn, once there is room (a start
            # is refused meanwhile: its save comes before its gate opens)
            if self.registry_full is None:
                log.error("registry_disk_full", path=str(self.registry.path),
                          error=os.strerror(exc.errno))
            self.registry_full = os.strerror(exc.errno)
        else:
            if self.registry_full is not None:
                log.info("registry_disk_resumed", path=str(self.registry.path))
            self.registry_full = None
        if self.registry.saves != saves:  # only a save lets entries go
            self._forget_old()

    def _note_disk_full(self) -> None:
        """Log a terminal's log entering and leaving the full-disk state."""
        for job in self.jobs.values():
            if not isinstance(job, Terminal):
                continue
            if job.disk_full is not None and job.proc_id not in self.logs_full:
                self.logs_full.add(job.proc_id)
                log.error("job_log_disk_full", proc_id=job.proc_id, error=job.disk_full,
                          held_bytes=len(job.unwritten))
            elif job.disk_full is None and job.proc_id in self.logs_full:
                self.logs_full.discard(job.proc_id)
                log.info("job_log_resumed", proc_id=job.proc_id)
        self.logs_full &= set(self.jobs)

    def _forget_old(self) -> None:
        """Drop from memory the ended jobs the registry let go (it keeps the
        newest ended ones): `remember()` answers for them from their files. A
        job whose tree is still being ended stays until its SIGKILL went out."""
        for proc_id, job in list(self.jobs.items()):
            if (not job.running and proc_id not in self.registry.entries
                    and (job.kill_deadline is None or job.killed_hard)):
                del self.jobs[proc_id]

    def _ended(self, job: Job) -> None:
        entry = job.entry
        self._bury(job)
        self.registry.ended(entry.proc_id)
        write_end_file(entry)
        self._count_end(job)
        event = "proc_exit" if entry.kind == "command" else "terminal_end"
        self.facts.record(entry.session, event, f"{entry.proc_id}:end", proc_id=entry.proc_id,
                          state=entry.state, exit_code=entry.exit_code,
                          log_bytes=job.log_size(), reason=entry.kill_reason)
        log.info("proc_ended", proc_id=entry.proc_id, state=entry.state,
                 exit_code=entry.exit_code, reason=entry.kill_reason)
        if isinstance(job, Terminal) and job.dropped:
            log.error("job_log_output_dropped", proc_id=entry.proc_id, bytes=job.dropped,
                      reason="the disk stayed full until the terminal's lifetime passed")

    def _count_end(self, job: Job) -> None:
        self.counters.ended += 1
        self.counters.by_state[job.entry.state] = self.counters.by_state.get(job.entry.state, 0) + 1

    def busy(self) -> bool:
        return bool(self._deferred) or any(
            j.running or (j.kill_deadline is not None and not j.killed_hard)
            for j in self.jobs.values()
        )

    def terminal_fds(self) -> list[int]:
        return [j.master_fd for j in self.jobs.values()
                if isinstance(j, Terminal) and j.master_fd is not None and j.running]

    def defer(self, sender: str, msg_id: str, ready: Callable[[], bool],
              reply: Callable[[], protocol.Message], *, timeout_s: float,
              on_due: Callable[[], None] | None = None) -> None:
        """Reply when `ready()` (or at the deadline). A request resent while
        its reply is still deferred (broker/peer.py `resend_s`) is answered by
        the one already waiting: once, and with the first one's deadline (a
        resend must not push a foreground command's timeout back)."""
        if any(d.sender == sender and d.msg_id == msg_id for d in self._deferred):
            return
        self._deferred.append(_Deferred(sender, msg_id, ready, reply,
                                        time.monotonic() + timeout_s, on_due))

    def statistics(self) -> ProcsStats:
        live = [j for j in self.jobs.values() if j.running]
        by = self.counters.by_state
        return ProcsStats(
            live_commands=sum(1 for j in live if j.entry.kind == "command"),
            live_terminals=sum(1 for j in live if j.entry.kind == "terminal"),
            started_total=self.counters.started, ended_total=self.counters.ended,
            killed_total=by.get("killed", 0), capped_total=by.get("capped", 0),
            expired_total=by.get("expired", 0), lost_total=by.get("lost", 0),
            reattached_total=self.counters.reattached, requests_total=self.counters.requests,
            refused_total=self.counters.refused,
            log_disk_full=len(self.logs_full),
            registry_disk_full=int(self.registry_full is not None),
        )

    def shutdown(self) -> None:
        """SIGTERM to procs: end every job (no orphans), then return."""
        self.mcp.shutdown()
        for job in self.jobs.values():
            if job.running:
                job.kill("shutdown")
        deadline = time.monotonic() + self.options.kill_grace_s + SETTLE_MARGIN_S
        while time.monotonic() < deadline and not all(
            j.settled() for j in self.jobs.values() if j.kill_deadline is not None
        ):
            self.reap()
            self.refresh()
            time.sleep(self.options.tick_s)  # a bounded wait at exit, no one to answer
        for job in self.jobs.values():
            self._bury(job)
        self._remove_dead_groups()
        if self.layout is not None:
            cgroup.release(self.layout)
        self.registry.save()
