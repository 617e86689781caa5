"""Which sessions a sender may act on: checked first on every request.

See docs/procs.md ("Who may act on a session").
"""

from __future__ import annotations

from broker import auth

CHILD_ACTIONS = frozenset({"session_end"})  # what the subagents host may do to a child
RUNNER_INFIX = ".pl-"  # an in-process pipeline runner: `<agent>.pl-<call>` (runner_name)


def owner_of(session: str) -> str:
    """The agent whose workspace, spec and network policy a session uses: an
    in-process pipeline runner `A.pl-<call>` (no spec of its own) is its agent
    `A`'s; any other session is its own. A runner's call id has no `.pl-`
    (runner_name), so the agent is what precedes the last one. Only `A` (or
    the operator) may name `A.pl-*` (session_refusal), so this grants nothing
    `A` does not have."""
    agent, infix, call = session.rpartition(RUNNER_INFIX)
    return agent if infix and agent and call else session


def session_refusal(sender: str, session: str, kind: str) -> str | None:
    """None when `sender` may send a request of `kind` naming `session`; else why not."""
    if sender in (session, auth.OPERATOR):
        return None
    if sender == auth.SUBAGENTS and "." in session:
        if kind in CHILD_ACTIONS:
            return None
        return f"the subagents host may only end a child's session, not send {kind}"
    if sender not in auth.RESERVED and session.startswith(sender + RUNNER_INFIX):
        return None
    return f"session {session} is not {sender}'s"
