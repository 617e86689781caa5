"""The operator's time-travel commands: `rewind` and `fork`.

See docs/trees.md ("Rewind", "Fork").
"""

# ruff: noqa: PLC0415

from __future__ import annotations

import json
import sys
from typing import Any

from broker.statedir import StateDir

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
