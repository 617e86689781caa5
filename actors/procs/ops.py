"""The agent ops served by procs: `bash`, `bash_*` and `terminal_*`.

Every op here is `replay_safe` (msg_ids derive from the call id).
See docs/agents.md ("Ops") and docs/procs.md.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from actors.kernel import workspace
from actors.kernel.ops import Done, OpBase, OpContext, OpSpec, Outcome
from actors.procs.client import KILL_REPLY_MARGIN_S, ProcsClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError

ProcIdField = Annotated[str, Field(pattern=r"^[pt]-[0-9a-f]{16}$")]
Command = Annotated[str, Field(min_length=1, max_length=64 * 1024)]
TERMINAL_SHELL = "/bin/bash"


def _client(ctx: OpContext) -> ProcsClient | None:
    peer = getattr(ctx, "peer", None)
    return ProcsClient(peer, ctx.agent) if peer is not None else None


def _cwd(ctx: OpContext, rel: str) -> str:
    return str(ctx.workspace.resolve() if rel in ("", ".") else
               workspace.resolve(ctx.workspace, rel, write=False))


def _msg_id(ctx: OpContext, prefix: str) -> str | None:
    """The request's msg_id, from the call: the same call is the same request."""
    return f"{prefix}:{ctx.call_id}" if ctx.call_id else None


def _out(ctx: OpContext, out: protocol.ProcOutput) -> dict[str, Any]:
    text = out.data.decode("utf-8", "replace")
    clipped = text[: ctx.max_result_chars]
    return {"proc_id": out.proc_id, "output": clipped, "truncated": len(clipped) < len(text),
            "next_cursor": out.cursor + len(out.data), "state": out.state,
            "exit_code": out.exit_code, "eof": out.eof}


def _status(st: protocol.ProcStatus) -> dict[str, Any]:
    return {"proc_id": st.proc_id, "state": st.state, "exit_code": st.exit_code,
            "log_bytes": st.log_bytes}


def _call(ctx: OpContext, body: Any) -> Outcome:
    """Run `body(client)`; unreachable procs and refusals become op errors."""
    client = _client(ctx)
    if client is None:
        return Done({"error": "procs is not reachable: this agent has no broker connection"},
                    ok=False)
    try:
        result: dict[str, Any] = body(client)
    except RemoteError as exc:
        return Done({"error": f"{exc.code}: {exc.detail}"[:500]}, ok=False)
    except RequestTimeoutError:
        # past the call's deadline: a typed timeout, and the agent goes on
        return Done({"error": "procs did not answer within the call's deadline",
                     "timeout": True}, ok=False, status="timeout")
    return Done(result, ok=result.get("state") != "lost")


class _ProcsOp(OpBase):
    replay_safe: ClassVar[bool] = True
    # a request to procs waits at most 4 attempts of KILL_REPLY_MARGIN_S (client.py)
    call_deadline_s: ClassVar[float] = 4 * KILL_REPLY_MARGIN_S


class BashOp(_ProcsOp):
    """Run a shell command in the foreground and return its output (timeout kills it)."""

    op: Literal["bash"] = "bash"
    command: Command
    cwd: str = "."
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    command_field: ClassVar[str | None] = "command"
    path_field: ClassVar[str | None] = "cwd"

    def deadline_s(self, ctx: OpContext) -> float:
        # the client waits timeout + margin for the reply, and resends once
        return 2 * (command_timeout_s(self, ctx) + KILL_REPLY_MARGIN_S)


def command_timeout_s(op: BashOp, ctx: OpContext) -> float:
    """The command's own timeout, bounded by `agent.max_command_timeout_s`."""
    return min(op.timeout_s, ctx.max_command_timeout_s)


class BashStartOp(_ProcsOp):
    """Start a background command; poll its output with bash_poll."""

    op: Literal["bash_start"] = "bash_start"
    command: Command
    cwd: str = "."
    lifetime_s: Annotated[float, Field(gt=0, le=24 * 3600)] | None = None
    command_field: ClassVar[str | None] = "command"
    path_field: ClassVar[str | None] = "cwd"


class BashPollOp(_ProcsOp):
    """Read a background command's output after `cursor`, and its exit status once known."""

    op: Literal["bash_poll"] = "bash_poll"
    proc_id: ProcIdField
    cursor: Annotated[int, Field(ge=0)] = 0


class BashKillOp(_ProcsOp):
    """End a background command and everything it started."""

    op: Literal["bash_kill"] = "bash_kill"
    proc_id: ProcIdField


class TerminalStartOp(_ProcsOp):
    """Start an interactive program on a terminal (e.g. `python3 -i`)."""

    op: Literal["terminal_start"] = "terminal_start"
    command: Command
    cwd: str = "."
    lifetime_s: Annotated[float, Field(gt=0, le=24 * 3600)] | None = None
    command_field: ClassVar[str | None] = "command"
    path_field: ClassVar[str | None] = "cwd"


class TerminalInputOp(_ProcsOp):
    """Type text into a terminal (include a newline to submit a line)."""

    op: Literal["terminal_input"] = "terminal_input"
    proc_id: ProcIdField
    text: Annotated[str, Field(max_length=16 * 1024)]
    secret_fields: ClassVar[tuple[str, ...]] = ("text",)


class TerminalReadOp(_ProcsOp):
    """Read a terminal's output after `cursor`."""

    op: Literal["terminal_read"] = "terminal_read"
    proc_id: ProcIdField
    cursor: Annotated[int, Field(ge=0)] = 0


class TerminalEndOp(_ProcsOp):
    """End a terminal's program."""

    op: Literal["terminal_end"] = "terminal_end"
    proc_id: ProcIdField


def bash(op: BashOp, ctx: OpContext) -> Outcome:
    cwd = _cwd(ctx, op.cwd)
    timeout_s = command_timeout_s(op, ctx)
    done = _call(ctx, lambda c: _out(ctx, c.bash(op.command, cwd, timeout_s=timeout_s,
                                                     msg_id=_msg_id(ctx, "b"))))
    if isinstance(done, Done) and done.result.get("state") == "expired":
        # procs ended the command at its timeout: the call's typed timeout
        return Done({**done.result, "error": f"timed out after {timeout_s:g}s",
                     "timeout": True}, ok=False, status="timeout")
    return done


def bash_start(op: BashStartOp, ctx: OpContext) -> Outcome:
    cwd = _cwd(ctx, op.cwd)
    return _call(ctx, lambda c: _status(c.start(op.command, cwd, lifetime_s=op.lifetime_s,
                                                        msg_id=_msg_id(ctx, "s"))))


def bash_poll(op: BashPollOp, ctx: OpContext) -> Outcome:
    return _call(ctx, lambda c: _out(ctx, c.poll(op.proc_id, op.cursor)))


def bash_kill(op: BashKillOp, ctx: OpContext) -> Outcome:
    return _call(ctx, lambda c: _status(c.kill(op.proc_id, _msg_id(ctx, "k"))))


def terminal_start(op: TerminalStartOp, ctx: OpContext) -> Outcome:
    cwd = _cwd(ctx, op.cwd)
    return _call(ctx, lambda c: _status(c.terminal_start(
        [TERMINAL_SHELL, "-c", op.command], cwd, lifetime_s=op.lifetime_s,
        msg_id=_msg_id(ctx, "t"))))


def terminal_input(op: TerminalInputOp, ctx: OpContext) -> Outcome:
    return _call(ctx, lambda c: _status(c.terminal_input(op.proc_id, op.text.encode(),
                                                          _msg_id(ctx, "i"))))


def terminal_read(op: TerminalReadOp, ctx: OpContext) -> Outcome:
    return _call(ctx, lambda c: _out(ctx, c.terminal_read(op.proc_id, op.cursor)))


def terminal_end(op: TerminalEndOp, ctx: OpContext) -> Outcome:
    return _call(ctx, lambda c: _status(c.terminal_end(op.proc_id, _msg_id(ctx, "e"))))


OPS = (OpSpec(BashOp, bash), OpSpec(BashStartOp, bash_start), OpSpec(BashPollOp, bash_poll),
       OpSpec(BashKillOp, bash_kill), OpSpec(TerminalStartOp, terminal_start),
       OpSpec(TerminalInputOp, terminal_input), OpSpec(TerminalReadOp, terminal_read),
       OpSpec(TerminalEndOp, terminal_end))
