"""The operator's time-travel commands: `rewind` and `fork`.

See docs/trees.md ("Rewind", "Fork").
"""

# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from broker.statedir import StateDir
from supervisor.cli.command import Command, Parents

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SUPERVISOR, EXIT_NO_ANSWER = 0, 1, 2, 3, 4
STOPPED = frozenset({"stopped", "exited", "fatal"})


def resolve_ref(state_dir: StateDir, ref: str, *, newest_only: bool = True
                ) -> tuple[str, str | None]:
    """The agent a session reference names, and the session when the reference
    names one that is not the agent's newest (None: the newest). The sessions
    resolver reads it (full id / prefix / agent name). A rewind moves within
    the agent's newest session (`newest_only`); a fork may start from any."""
    from actors.sessions.resolve import SessionPurgingError, SessionRefError, resolve
    from broker.statedir import check_actor_name

    try:
        found = resolve(state_dir.root, ref)
    except SessionPurgingError:
        raise
    except SessionRefError:
        return check_actor_name(ref), None  # an agent the index has no session of
    if resolve(state_dir.root, found.agent).session_id == found.session_id:
        return found.agent, None
    if newest_only:
        raise SessionRefError(f"session {found.session_id} is not the newest of agent "
                              f"{found.agent}: a rewind moves within the newest session; "
                              f"`supervisor fork {found.session_id} --name NEW` starts a new "
                              f"agent from it")
    return found.agent, found.session_id


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"supervisor: {message}", file=sys.stderr)
    return code


def agent_running(state_dir: StateDir, agent: str) -> str | None:
    """The agent's process state when it is not stopped (or the supervisor's
    silence); None when it is stopped or no supervisor runs here."""
    from supervisor.statusclient import NoAnswerError, RefusedError, ask_status

    if not (state_dir.run_dir / "supervisor.sock").exists():
        return None  # no supervisor: nothing runs the agent under it
    try:
        reply = ask_status(state_dir, 3.0)
    except (NoAnswerError, RefusedError, OSError) as exc:
        return f"unknown (the supervisor did not answer: {exc})"
    for child in reply.get("children", []):
        if child.get("name") == agent and child.get("state") not in STOPPED:
            return str(child.get("state"))
    return None


def _with_writer(state_dir: StateDir, agent: str, action: Any) -> int:
    import zmq

    from actors.writer.client import WriterClient
    from broker import auth
    from broker.errors import CorralError, RequestTimeoutError

    if not state_dir.root.is_dir():
        return _fail(f"no state directory {state_dir.root}", EXIT_NO_SUPERVISOR)
    running = agent_running(state_dir, agent)
    if running is not None:
        return _fail(f"agent {agent} is {running}: stop it first (`supervisor stop {agent}`)")
    try:
        credential = auth.operator_credential(state_dir)
    except CorralError as exc:
        return _fail(str(exc))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    writer = WriterClient(ctx, state_dir, "operator", timeout_s=5.0, retries=2,
                          credential=credential)
    try:
        code: int = action(writer)
    except RequestTimeoutError:
        return _fail(f"the writer of {state_dir.root} did not answer", EXIT_NO_ANSWER)
    except CorralError as exc:
        return _fail(str(exc))
    finally:
        writer.close()
        ctx.destroy(linger=0)
    return code


def rewind(state_dir: StateDir, ref: str, *, to_turn: int | None, to_seq: int | None,
           as_json: bool) -> int:
    if (to_turn is None) == (to_seq is None):
        return _fail("give exactly one of --to-turn N and --to-seq S", EXIT_USAGE)
    from broker.errors import CorralError

    try:
        agent, _ = resolve_ref(state_dir, ref)
    except CorralError as exc:
        return _fail(str(exc), EXIT_USAGE)

    def act(writer: Any) -> int:
        from actors.trees import rewind as rewinding

        done = rewinding.rewind(writer, state_dir, agent, to_turn=to_turn, to_seq=to_seq)
        if as_json:
            print(json.dumps({"agent": agent, "to_seq": done.to_seq, "to_turn": done.to_turn,
                              "tree": done.tree, "removed": done.removed,
                              "written": done.written, "noop": done.noop}))
        elif done.noop:
            print(f"supervisor: {agent} is already at seq {done.to_seq}: nothing to do")
        else:
            print(f"supervisor: rewound {agent} to seq {done.to_seq}"
                  f"{f' (turn {done.to_turn})' if done.to_turn is not None else ''}: "
                  f"{done.written} files written, {done.removed} removed")
        return EXIT_OK

    return _with_writer(state_dir, agent, act)


def fork(state_dir: StateDir, ref: str, new: str, *, at_turn: int | None, as_json: bool) -> int:
    from broker.errors import CorralError

    try:
        agent, session = resolve_ref(state_dir, ref, newest_only=False)
    except CorralError as exc:
        return _fail(str(exc), EXIT_USAGE)

    def act(writer: Any) -> int:
        from actors.trees import fork as forking

        done = forking.fork(writer, state_dir, agent, new, at_turn=at_turn, session=session)
        if as_json:
            print(json.dumps({"agent": done.name, "parent": agent, "session": session,
                              "point_seq": done.point_seq, "point_turn": done.point_turn,
                              "tree": done.tree, "files": done.files}))
        else:
            of = f" (session {session})" if session is not None else ""
            print(f"supervisor: forked {agent}{of} at turn {done.point_turn} (seq "
                  f"{done.point_seq}) as {done.name}: {done.files} files; "
                  f"`supervisor start {done.name}` runs it")
        return EXIT_OK

    return _with_writer(state_dir, agent, act)


def _add_rewind(sub: Any, parents: Parents) -> None:
    back = sub.add_parser("rewind", parents=[parents.common, parents.as_json],
                          help="rewind a stopped session to a turn (supervisor/cli/trees.py)")
    back.add_argument("ref", help="an agent's name (its newest session), or that session's id")
    back.add_argument("--to-turn", type=int, default=None,
                      help="keep turns 1..N of the newest session")
    back.add_argument("--to-seq", type=int, default=None,
                      help="cut at this record of the newest session's active branch")


def _run_rewind(args: argparse.Namespace) -> int:
    return rewind(StateDir.resolve(args.state_dir), args.ref, to_turn=args.to_turn,
                  to_seq=args.to_seq, as_json=args.json)


def _add_fork(sub: Any, parents: Parents) -> None:
    branch = sub.add_parser("fork", parents=[parents.common, parents.as_json],
                            help="fork a session into a new agent at a turn")
    branch.add_argument("ref", help="a session id (or a unique prefix), or an agent's name "
                                    "(its newest session)")
    branch.add_argument("--name", required=True, help="the new agent's name")
    branch.add_argument("--at-turn", type=int, default=None,
                        help="after this turn of that session (default: its last)")


def _run_fork(args: argparse.Namespace) -> int:
    return fork(StateDir.resolve(args.state_dir), args.ref, args.name, at_turn=args.at_turn,
                as_json=args.json)


COMMANDS = (Command("rewind", _add_rewind, _run_rewind), Command("fork", _add_fork, _run_fork))
