"""The operator's agent commands: approve, deny, answer, correct, resume, and the
work of `spawn` (supervisor/cli/spawn.py declares it: it may go to another host).

Each rebuilds the agent's state to check what it answers is pending, then
appends under a key derived from the request. See docs/agents.md
("Commands", "Approvals") and docs/operator-input.md.
"""

# Imports inside functions are deliberate: each path loads only what it needs.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.statedir import StateDir
from supervisor.cli.command import Command, Parents

if TYPE_CHECKING:
    from actors.kernel.state import AgentState
    from actors.writer.client import WriterClient

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_SUPERVISOR = 3
EXIT_NO_ANSWER = 4


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"supervisor: {message}", file=sys.stderr)
    return code


class OperatorRefusedError(Exception):
    """An operator action refused before or while it was recorded: the message is
    the CLI's one line, `code` its exit code (the console answers it as a 409)."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def operator_act(state_dir: StateDir, agent: str, action: Any) -> str:
    """Run `action(writer, state)` with the agent's rebuilt state, as the operator;
    returns its line. Refusals raise OperatorRefusedError. The CLI and the web
    console (supervisor/console/) both answer through here."""
    import zmq

    from actors.sessions.rebuild import rebuild
    from broker.errors import CorralError, RequestTimeoutError
    from broker.statedir import check_actor_name
    from supervisor import client

    try:
        check_actor_name(agent)
    except CorralError as exc:
        raise OperatorRefusedError(str(exc), EXIT_USAGE) from exc
    if not client.running(state_dir):
        raise OperatorRefusedError(f"no supervisor for {state_dir.root}", EXIT_NO_SUPERVISOR)
    from actors.writer.client import WriterClient
    from broker import auth

    try:
        credential = auth.operator_credential(state_dir)
    except CorralError as exc:
        raise OperatorRefusedError(str(exc)) from exc
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    writer = WriterClient(ctx, state_dir, "operator", timeout_s=2.0, retries=2,
                          credential=credential)
    try:
        state = rebuild(writer, state_dir, agent).state
        if state.counts.events == 0:
            raise OperatorRefusedError(f"agent {agent} has no session in {state_dir.root}")
        line: str = action(writer, state)
    except RequestTimeoutError as exc:
        raise OperatorRefusedError(f"the writer of {state_dir.root} did not answer",
                                   EXIT_NO_ANSWER) from exc
    except CorralError as exc:
        raise OperatorRefusedError(str(exc)) from exc
    finally:
        writer.close()
        ctx.destroy(linger=0)
    return line


def _with_writer(state_dir: StateDir, agent: str, action: Any) -> int:
    """`operator_act` for the CLI: the line on stdout, a refusal on stderr."""
    try:
        line = operator_act(state_dir, agent, action)
    except OperatorRefusedError as exc:
        return _fail(str(exc), exc.code)
    print(f"supervisor: {line}")
    return EXIT_OK


def answer_approval(writer: WriterClient, agent: str, state: AgentState, request: str, *,
                    decision: str, always: bool, note: str | None) -> str:
    """Append the answer to a pending request; returns a line for the operator.
    Raises LookupError when the request is not pending."""
    approval = state.approvals.get(request)
    if approval is None:
        pending = ", ".join(a.request for a in state.pending_approvals()) or "none"
        raise LookupError(f"agent {agent} has no request {request} (pending: {pending})")
    if approval.status != "pending":
        raise LookupError(f"request {request} of {agent} is already {approval.status}")
    if approval.kind == "clarification":
        raise LookupError(f"{request} of {agent} is a question, not a permission: answer it "
                          f"with `supervisor answer {agent} {request} TEXT` (an approval "
                          "never answers a question)")
    writer.append(f"agent/{agent}", "approval_answer", {
        "request": request, "decision": decision, "always": always, "note": note,
        "op": approval.op, "pattern": approval.pattern,
    }, key=(f"answer:{state.session}:{request}" if state.session  # requests repeat
            else f"answer:{agent}:{request}"), ledger="approvals")  # from session to session
    scope = f" (always: {approval.op} {approval.pattern})" if always else ""
    verb = "approved" if decision == "approve" else "denied"
    return f"{verb} {agent} {request}: {approval.op} {approval.pattern}{scope}"


def approve(state_dir: StateDir, agent: str, request: str, *, deny: bool, always: bool,
            note: str | None) -> int:
    if deny and always:
        return _fail("--always applies to approve only", EXIT_USAGE)

    return _with_writer(state_dir, agent, approval_action(agent, request, deny=deny,
                                                          always=always, note=note))


def approval_action(agent: str, request: str, *, deny: bool, always: bool,
                    note: str | None) -> Any:
    """`approve`/`deny` as an action for `operator_act`."""
    def act(writer: WriterClient, state: AgentState) -> str:
        try:
            return answer_approval(writer, agent, state, request,
                                   decision="deny" if deny else "approve", always=always,
                                   note=note)
        except LookupError as exc:
            raise OperatorRefusedError(str(exc)) from exc

    return act


def _input_text(text: str | None, file: str | None) -> str:
    """TEXT or the content of --file F (exactly one of them)."""
    if (text is None) == (file is None):
        raise ValueError("give the text or --file F (one of them)")
    if file is None:
        return str(text)
    try:
        return Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc


def answer(state_dir: StateDir, agent: str, request: str, text: str | None,
           file: str | None) -> int:
    """`supervisor answer AGENT REQUEST TEXT | --file F`: the exact answer to a question."""
    try:
        body = _input_text(text, file)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)

    return _with_writer(state_dir, agent, answer_action(state_dir, agent, request, body))


def answer_action(state_dir: StateDir, agent: str, request: str, body: str) -> Any:
    """`answer` as an action for `operator_act`."""
    from actors.kernel import operator_input

    def act(writer: WriterClient, state: AgentState) -> str:
        try:
            return operator_input.record_answer(writer, state_dir.agent_dir(agent), agent,
                                                state, request, text=body)
        except operator_input.InputRefusedError as exc:
            raise OperatorRefusedError(str(exc)) from exc

    return act


def correct(state_dir: StateDir, agent: str, text: str | None, file: str | None) -> int:
    """`supervisor correct AGENT TEXT | --file F`: one correction for the next model request."""
    try:
        body = _input_text(text, file)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)

    return _with_writer(state_dir, agent, correction_action(state_dir, agent, body))


def correction_action(state_dir: StateDir, agent: str, body: str) -> Any:
    """`correct` as an action for `operator_act`."""
    from actors.kernel import operator_input

    def act(writer: WriterClient, state: AgentState) -> str:
        try:
            return operator_input.record_correction(writer, state_dir.agent_dir(agent), agent,
                                                    state, body)
        except operator_input.InputRefusedError as exc:
            raise OperatorRefusedError(str(exc)) from exc

    return act


REQUEST_ID = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


def resume_key(agent: str, state: AgentState, request_id: str) -> str:
    """The idempotency key of one resume request: the session and the request's
    own id. Each command is a request of its own (a second resume, after one
    that was not enough, is a new grant); the same request sent again (the
    writer client's retries, or the operator's `--request-id` retry after a
    lost answer) is written once."""
    return f"resume:{state.session or agent}:{request_id}"


def resume(state_dir: StateDir, agent: str, tokens: int, cost_units: float,
           request_id: str | None = None) -> int:
    if tokens < 0 or cost_units < 0:
        return _fail("--budget and --cost-units must be >= 0", EXIT_USAGE)
    if request_id is not None and not REQUEST_ID.fullmatch(request_id):
        return _fail(f"--request-id {request_id!r}: use 1-40 of [A-Za-z0-9_.-]", EXIT_USAGE)
    rid = request_id or f"r{secrets.token_hex(4)}"
    return _with_writer(state_dir, agent, resume_action(agent, tokens, cost_units, rid))


def resume_action(agent: str, tokens: int, cost_units: float, request_id: str) -> Any:
    """`resume` as an action for `operator_act`."""
    from broker.errors import RequestTimeoutError

    def act(writer: WriterClient, state: AgentState) -> str:
        if state.phase != "paused":
            raise OperatorRefusedError(f"agent {agent} is {state.phase}, not paused on its "
                                       "budget")
        try:
            ack = writer.append(f"agent/{agent}", "budget_resumed",
                                {"tokens": tokens, "cost_units": cost_units,
                                 "segment": state.segment, "request": request_id},
                                key=resume_key(agent, state, request_id), ledger="budget")
        except RequestTimeoutError as exc:
            raise OperatorRefusedError(
                f"the writer did not answer: resume {request_id} of {agent} may or may not "
                f"be recorded; retry with `supervisor resume {agent} --budget {tokens} "
                f"--cost-units {cost_units:g} --request-id {request_id}` (written once)",
                EXIT_NO_ANSWER) from exc
        if ack.duplicate:
            return (f"resume {request_id} of {agent} was already recorded (seq {ack.seq}): "
                    "nothing more added")
        return (f"resumed {agent}: +{tokens} tokens, +{cost_units:g} cost units "
                f"(request {request_id}, seq {ack.seq})")

    return act


def spawn(state_dir: StateDir, name: str, task: str, model: str | None, *,
          as_json: bool = False) -> int:
    """Ask the running supervisor to add an agent. The supervisor writes the spec
    from *its* configuration's `agent:` settings, and only when it accepts."""
    import json

    from actors.kernel.settings import load_task, parse_model
    from broker import protocol
    from broker.errors import CorralError, RemoteError, RequestTimeoutError
    from broker.requester import new_msg_id
    from broker.statedir import check_actor_name
    from supervisor import client

    def done(code: int, line: str, **data: Any) -> int:
        if as_json:
            print(json.dumps({"ok": code == EXIT_OK, "command": "spawn", "target": name,
                              **data}))
        if code != EXIT_OK:
            return _fail(line, code)
        if not as_json:
            print(f"supervisor: {line}")
        return code

    try:
        check_actor_name(name)
        chosen = parse_model(model)
    except (CorralError, ValueError) as exc:
        return done(EXIT_USAGE, str(exc), error="usage")
    task_path = Path(task).resolve()
    try:
        load_task(task_path)  # the operator hears of a bad task file here, in one line
    except CorralError as exc:
        return done(EXIT_FAILED, str(exc).splitlines()[0], error="task")
    message = protocol.SpawnRequest(msg_id=new_msg_id("sp"), name=name, task=str(task_path),
                                    backend=chosen["backend"], model=chosen.get("model"),
                                    replay_stream=chosen.get("replay_stream"))
    try:
        client.ask(state_dir, message, timeout_s=5.0)
    except client.NoSupervisorError:
        return done(EXIT_NO_SUPERVISOR, f"no supervisor for {state_dir.root}",
                    error="no_supervisor")
    except RequestTimeoutError:
        return done(EXIT_NO_ANSWER, f"no answer from the supervisor of {state_dir.root}",
                    error="no_answer")
    except RemoteError as exc:
        return done(EXIT_FAILED, f"spawn refused: {exc.detail}", error=str(exc.code),
                    detail=exc.detail)
    return done(EXIT_OK, f"spawned {name} ({chosen['backend']}, task {task_path.name})",
                affected=[name], backend=chosen["backend"], task=str(task_path))


def _add_verdict(verb: str) -> Callable[[Any, Parents], None]:
    """`approve` and `deny`."""

    def add(sub: Any, parents: Parents) -> None:
        verdict = sub.add_parser(verb, parents=[parents.common], help=f"{verb} an agent's request")
        verdict.add_argument("agent")
        verdict.add_argument("request")
        verdict.add_argument("--note", default=None)
        if verb == "approve":
            verdict.add_argument("--always", action="store_true",
                                 help="also allow this op on this pattern from now on")

    return add


def _run_approve(args: argparse.Namespace) -> int:
    return approve(StateDir.resolve(args.state_dir), args.agent, args.request, deny=False,
                   always=args.always, note=args.note)


def _run_deny(args: argparse.Namespace) -> int:
    return approve(StateDir.resolve(args.state_dir), args.agent, args.request, deny=True,
                   always=False, note=args.note)


def _add_answer(sub: Any, parents: Parents) -> None:
    reply = sub.add_parser("answer", parents=[parents.common], help="answer an agent's question")
    reply.add_argument("agent")
    reply.add_argument("request")
    reply.add_argument("text", nargs="?", default=None)
    reply.add_argument("--file", default=None, help="read the answer from this file")


def _run_answer(args: argparse.Namespace) -> int:
    return answer(StateDir.resolve(args.state_dir), args.agent, args.request, args.text,
                  args.file)


def _add_correct(sub: Any, parents: Parents) -> None:
    correction = sub.add_parser("correct", parents=[parents.common],
                                help="tell an agent something at its next model request")
    correction.add_argument("agent")
    correction.add_argument("text", nargs="?", default=None)
    correction.add_argument("--file", default=None, help="read the correction from this file")


def _run_correct(args: argparse.Namespace) -> int:
    return correct(StateDir.resolve(args.state_dir), args.agent, args.text, args.file)


def _add_resume(sub: Any, parents: Parents) -> None:
    more = sub.add_parser("resume", parents=[parents.common],
                          help="resume an agent paused on budget")
    more.add_argument("agent")
    more.add_argument("--budget", type=int, required=True, help="tokens to add")
    more.add_argument("--cost-units", type=float, default=0.0, help="cost units to add")
    more.add_argument("--request-id", default=None, metavar="ID",
                      help="this request's id (default: a new one); the same id again "
                           "is written once (docs/operator-input.md)")


def _run_resume(args: argparse.Namespace) -> int:
    return resume(StateDir.resolve(args.state_dir), args.agent, args.budget, args.cost_units,
                  args.request_id)


COMMANDS = (
    Command("approve", _add_verdict("approve"), _run_approve),
    Command("deny", _add_verdict("deny"), _run_deny),
    Command("answer", _add_answer, _run_answer),
    Command("correct", _add_correct, _run_correct),
    Command("resume", _add_resume, _run_resume),
)
