"""Request handlers: one function per procs message, dispatched by `handle`.

Ownership is checked first; unasked replies and errors are dropped.
See docs/procs.md ("Messages").
"""

from __future__ import annotations

import os

import structlog

from actors.procs.facts import sha256
from actors.procs.host import SETTLE_MARGIN_S, ProcsHost, RefusedError
from actors.procs.job import Job
from actors.procs.ownership import session_refusal
from actors.procs.registry import JobKind
from actors.procs.terminal import DISK_FULL_ERRNOS, InputRefusedError, Terminal
from broker import protocol, ratelimit

Code = protocol.ErrorCode
log = structlog.get_logger("procs")
_limiter = ratelimit.LogLimiter(log.warning)
_refusals = ratelimit.LogLimiter(log.warning, summary_event="session_refusals_suppressed")
Request = (
    protocol.Bash | protocol.BashStart | protocol.BashPoll | protocol.BashKill
    | protocol.TerminalStart | protocol.TerminalInput | protocol.TerminalRead
    | protocol.TerminalEnd | protocol.SessionEnd
)


def status(job: Job, msg_id: str) -> protocol.ProcStatus:
    e = job.entry
    return protocol.ProcStatus(msg_id=msg_id, proc_id=e.proc_id, state=e.state, pid=e.pid,
                               exit_code=e.exit_code, log_bytes=job.log_size())


def _job(host: ProcsHost, session: str, proc_id: str, kind: JobKind) -> Job:
    job = host.jobs.get(proc_id) or host.remember(session, kind, proc_id)
    if job is None or job.entry.session != session or job.entry.kind != kind:
        raise RefusedError(Code.NOT_FOUND, f"no {kind} {proc_id} in session {session}")
    return job


def _output(host: ProcsHost, job: Job, msg_id: str, *, cursor: int, max_bytes: int,
            event: str) -> protocol.ProcOutput:
    """Read after `cursor`; record the fact when bytes (or the end) enter context."""
    state, exit_code = job.entry.state, job.entry.exit_code  # before the read: no byte skipped
    data, eof = job.read(cursor, max_bytes)
    eof = eof and state != "running"
    next_cursor = cursor + len(data)
    if data or eof:
        e = job.entry
        host.facts.record(e.session, event, f"{e.proc_id}:read:{cursor}:{next_cursor}:{int(eof)}",
                          proc_id=e.proc_id, cursor=cursor, next_cursor=next_cursor,
                          data_sha256=sha256(data), state=state, exit_code=exit_code)
    return protocol.ProcOutput(msg_id=msg_id, proc_id=job.proc_id, cursor=cursor,
                               next_cursor=next_cursor, data=data, state=state,
                               exit_code=exit_code, eof=eof)


def _until_settled(host: ProcsHost, sender: str, msg_id: str, jobs: list[Job],
                   reply: protocol.Message | None = None) -> None:
    def ready() -> bool:
        return all(j.settled() for j in jobs)

    def answer() -> protocol.Message:
        return reply if reply is not None else status(jobs[0], msg_id)

    host.defer(sender, msg_id, ready, answer,
               timeout_s=host.options.kill_grace_s + SETTLE_MARGIN_S)


def handle(host: ProcsHost, sender: str, message: protocol.Message) -> None:
    if protocol.is_reply(message):
        # an error (or any reply) nobody here asked for: never answer it
        if _limiter.allow():
            log.warning("reply_dropped", sender=sender, kind=message.kind,
                        msg_id=getattr(message, "msg_id", None))
        return
    host.counters.requests += 1
    try:
        reply = _dispatch(host, sender, message)
    except RefusedError as exc:
        host.counters.refused += 1
        reply = protocol.Error(msg_id=getattr(message, "msg_id", None), code=exc.code,
                               detail=exc.detail[:2000])
    except OSError as exc:
        host.counters.refused += 1
        full = exc.errno in DISK_FULL_ERRNOS  # a start whose files find no room: retry later
        reply = protocol.Error(msg_id=getattr(message, "msg_id", None),
                               code=Code.STORAGE_FULL if full else Code.INTERNAL_ERROR,
                               detail=f"{type(exc).__name__}: {exc}"[:2000])
    except Exception as exc:  # the last line of defence: no request stops procs
        host.counters.refused += 1
        if _limiter.allow():
            log.exception("request_failed", kind=message.kind,
                          msg_id=getattr(message, "msg_id", None))
        reply = protocol.Error(msg_id=getattr(message, "msg_id", None),
                               code=Code.INTERNAL_ERROR, detail=f"failed: {type(exc).__name__}")
    if reply is not None:
        host.peer.send(sender, reply)


def _check_session(sender: str, message: protocol.Message) -> None:
    """Refuse (`forbidden`) a request naming a session the sender may not act on
    (actors/procs/ownership.py), before anything is started, read or ended."""
    if not isinstance(message, Request):
        return
    refusal = session_refusal(sender, message.session, message.kind)
    if refusal is None:
        return
    if _refusals.allow():
        log.warning("session_refused", sender=sender, session=message.session,
                    kind=message.kind, msg_id=message.msg_id)
    raise RefusedError(Code.FORBIDDEN, refusal)


def _dispatch(host: ProcsHost, sender: str, message: protocol.Message) -> protocol.Message | None:
    _check_session(sender, message)
    match message:
        case protocol.Ping(msg_id=msg_id):
            return protocol.Pong(msg_id=msg_id, actor=host.peer.name, pid=os.getpid())
        case protocol.StatsRequest(msg_id=msg_id):
            values = host.statistics().model_dump()
            return protocol.Stats(msg_id=msg_id, actor=host.peer.name, values=values)
        case protocol.Bash():
            job = host.start_command(message.session, message.msg_id, message.command,
                                     cwd=message.cwd, cap=message.max_output_bytes,
                                     lifetime_s=None, foreground=True)
            m = message
            host.defer(sender, m.msg_id, lambda: not job.running,
                       lambda: _output(host, job, m.msg_id, cursor=0, max_bytes=m.max_bytes,
                                       event="proc_poll"),
                       timeout_s=m.timeout_s, on_due=lambda: job.kill("timeout"))
            return None
        case protocol.BashStart():
            job = host.start_command(message.session, message.msg_id, message.command,
                                     cwd=message.cwd, cap=message.max_output_bytes,
                                     lifetime_s=message.lifetime_s, foreground=False)
            return status(job, message.msg_id)
        case protocol.BashPoll():
            job = _job(host, message.session, message.proc_id, "command")
            return _output(host, job, message.msg_id, cursor=message.cursor,
                           max_bytes=message.max_bytes, event="proc_poll")
        case protocol.BashKill() | protocol.TerminalEnd():
            kind: JobKind = "command" if isinstance(message, protocol.BashKill) else "terminal"
            job = _job(host, message.session, message.proc_id, kind)
            if job.running:
                host.facts.record(job.entry.session, "proc_kill", f"{job.proc_id}:kill",
                                  proc_id=job.proc_id, reason="request")
            job.kill("request")
            _until_settled(host, sender, message.msg_id, [job])
            return None
        case protocol.TerminalStart():
            return status(host.start_terminal(message), message.msg_id)
        case protocol.TerminalInput():
            job = _job(host, message.session, message.proc_id, "terminal")
            assert isinstance(job, Terminal)
            if job.typed(message.msg_id):
                return status(job, message.msg_id)  # a resend: typed once already
            if not job.running:
                raise RefusedError(Code.NOT_FOUND, f"terminal {job.proc_id} is {job.entry.state}")
            host.facts.record(job.entry.session, "terminal_input",
                              f"{job.proc_id}:in:{message.msg_id}", proc_id=job.proc_id,
                              data_sha256=sha256(message.data), data_bytes=len(message.data))
            try:
                job.send(message.data, message.msg_id)
            except InputRefusedError as exc:
                raise RefusedError(Code.RECIPIENT_BUSY, str(exc)) from exc
            return status(job, message.msg_id)
        case protocol.TerminalRead():
            job = _job(host, message.session, message.proc_id, "terminal")
            if isinstance(job, Terminal):
                job.pump()
            return _output(host, job, message.msg_id, cursor=message.cursor,
                           max_bytes=message.max_bytes, event="terminal_read")
        case protocol.SessionEnd():
            _session_end(host, sender, message)
            return None
        case protocol.McpRequest():
            return host.mcp.handle(sender, message)
        case _:
            raise RefusedError(Code.UNEXPECTED_MESSAGE, f"procs does not serve {message.kind}")


def _session_end(host: ProcsHost, sender: str, message: protocol.SessionEnd) -> None:
    jobs = [j for j in host.jobs.values() if j.entry.session == message.session]
    for job in jobs:
        job.kill("session_end")
    host.mcp.end_session(message.session)  # its MCP servers too (keyed by sender = session)
    session, msg_id = message.session, message.msg_id

    def ready() -> bool:
        return all(j.settled() for j in jobs)

    def answer() -> protocol.Message:
        for job in jobs:
            host.jobs.pop(job.proc_id, None)
            host.registry.drop(job.proc_id)
        host.facts.record(session, "session_end", f"session_end:{msg_id}", ended=len(jobs))
        return protocol.ProcStatus(msg_id=msg_id, proc_id=None, state="killed", ended=len(jobs))

    host.defer(sender, msg_id, ready, answer,
               timeout_s=host.options.kill_grace_s + SETTLE_MARGIN_S)
