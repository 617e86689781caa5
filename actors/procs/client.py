"""The agent side of procs: typed calls over a BrokerPeer, one per request.

A resent request keeps its msg_id, so a start never starts twice.
See docs/procs.md ("Messages").
"""

from __future__ import annotations

from broker import protocol
from broker.errors import ProtocolError, RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id

PROCS = "procs"
KILL_REPLY_MARGIN_S = 10.0  # a kill waits for the grace period and the sweep
# A foreground command's request is sent again this often while its reply is
# awaited (procs answers a resend of the same msg_id once, from the same job):
# a reply lost on the way (the broker restarted as procs answered) costs this,
# not the command's whole timeout
FOREGROUND_RESEND_S = 5.0


class ProcsClient:
    def __init__(self, peer: BrokerPeer, session: str, *, timeout_s: float = 5.0) -> None:
        self.peer = peer
        self.session = session
        self.timeout_s = timeout_s

    def _call(self, message: protocol.Message, timeout_s: float | None = None,
              retries: int = 3, resend_s: float | None = None) -> protocol.Message:
        return self.peer.request(PROCS, message, timeout_s=timeout_s or self.timeout_s,
                                 retries=retries, resend_s=resend_s)

    def _status(
        self, message: protocol.Message, timeout_s: float | None = None
    ) -> protocol.ProcStatus:
        reply = self._call(message, timeout_s)
        if not isinstance(reply, protocol.ProcStatus):
            raise ProtocolError("unexpected_message", f"{message.kind} answered with {reply.kind}")
        return reply

    def _output(self, message: protocol.Message, timeout_s: float | None = None,
                retries: int = 3, resend_s: float | None = None) -> protocol.ProcOutput:
        reply = self._call(message, timeout_s, retries, resend_s)
        if not isinstance(reply, protocol.ProcOutput):
            raise ProtocolError("unexpected_message", f"{message.kind} answered with {reply.kind}")
        return reply

    # --- commands -----------------------------------------------------------------
    def bash(self, command: str, cwd: str, *, timeout_s: float = 120.0,
             max_bytes: int = 64 * 1024,
             max_output_bytes: int | None = None,
             msg_id: str | None = None) -> protocol.ProcOutput:
        """Run in the foreground; the reply comes when it ends (or is timed out)."""
        message = protocol.Bash(
            msg_id=msg_id or new_msg_id("b"), session=self.session, command=command,
            cwd=cwd, timeout_s=timeout_s, max_bytes=max_bytes,
            max_output_bytes=max_output_bytes)
        return self._output(message, timeout_s + KILL_REPLY_MARGIN_S, retries=1,
                            resend_s=FOREGROUND_RESEND_S)

    def start(self, command: str, cwd: str, *, max_output_bytes: int | None = None,
              lifetime_s: float | None = None, msg_id: str | None = None) -> protocol.ProcStatus:
        return self._status(protocol.BashStart(
            msg_id=msg_id or new_msg_id("s"), session=self.session, command=command, cwd=cwd,
            max_output_bytes=max_output_bytes, lifetime_s=lifetime_s))

    def poll(
        self, proc_id: str, cursor: int = 0, max_bytes: int = 64 * 1024
    ) -> protocol.ProcOutput:
        return self._output(protocol.BashPoll(msg_id=new_msg_id("p"), session=self.session,
                                              proc_id=proc_id, cursor=cursor, max_bytes=max_bytes))

    def kill(self, proc_id: str, msg_id: str | None = None) -> protocol.ProcStatus:
        return self._status(protocol.BashKill(
            msg_id=msg_id or new_msg_id("k"), session=self.session, proc_id=proc_id),
            KILL_REPLY_MARGIN_S)

    # --- terminals ----------------------------------------------------------------
    def terminal_start(self, argv: list[str], cwd: str, *, max_output_bytes: int | None = None,
                       lifetime_s: float | None = None, rows: int = 24,
                       cols: int = 80, msg_id: str | None = None) -> protocol.ProcStatus:
        return self._status(protocol.TerminalStart(
            msg_id=msg_id or new_msg_id("t"), session=self.session, argv=argv, cwd=cwd, rows=rows,
            cols=cols, max_output_bytes=max_output_bytes, lifetime_s=lifetime_s))

    def terminal_input(self, proc_id: str, data: bytes,
                       msg_id: str | None = None) -> protocol.ProcStatus:
        return self._status(protocol.TerminalInput(
            msg_id=msg_id or new_msg_id("i"), session=self.session, proc_id=proc_id,
            data=data))

    def terminal_read(self, proc_id: str, cursor: int = 0,
                      max_bytes: int = 64 * 1024) -> protocol.ProcOutput:
        return self._output(protocol.TerminalRead(msg_id=new_msg_id("r"), session=self.session,
                                                  proc_id=proc_id, cursor=cursor,
                                                  max_bytes=max_bytes))

    def terminal_end(self, proc_id: str, msg_id: str | None = None) -> protocol.ProcStatus:
        return self._status(protocol.TerminalEnd(
            msg_id=msg_id or new_msg_id("e"), session=self.session, proc_id=proc_id),
            KILL_REPLY_MARGIN_S)

    def end_session(self) -> protocol.ProcStatus:
        return self._status(protocol.SessionEnd(msg_id=new_msg_id("x"), session=self.session),
                            KILL_REPLY_MARGIN_S)


def end_session_quietly(peer: BrokerPeer, session: str, timeout_s: float = 5.0) -> int | None:
    """End a finished session's jobs, best effort: None when procs is not
    running or did not answer (no retries: a session without jobs costs one
    round trip, an absent procs one refusal from the broker)."""
    try:
        reply = peer.request(PROCS, protocol.SessionEnd(msg_id=new_msg_id("x"), session=session),
                             timeout_s=timeout_s, retries=0)
    except (RemoteError, RequestTimeoutError):
        return None
    return reply.ended if isinstance(reply, protocol.ProcStatus) else None
