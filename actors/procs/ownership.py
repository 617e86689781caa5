"""Which sessions a sender may act on: the one rule procs applies to every
request that names a session (`bash`, `bash_start`, `bash_poll`, `bash_kill`,
`terminal_start`, `terminal_input`, `terminal_read`, `terminal_end`,
`session_end`), before anything else is looked at (actors/procs/requests.py).

The sender is the broker-authenticated name the request came from (the
broker names each peer by the name its connection authenticated as,
broker/auth.py; only operator connections name themselves). A session is
named after its agent (docs/procs.md). The rule:

- an agent `A` acts on session `A`, and on the sessions of the pipeline
  runners it runs in its own process (`A.pl-<call>`, actors/pipelines/ops.py:
  their steps reach procs through A's connection; the writer lets A append
  under those names the same way, broker/auth.py), nothing else;
- a subagent child `P.<id>` on `P.<id>` only (its parent's session is not its
  own, nor the other way round); `automation` (the supervisor's hook
  commands) on `automation`;
- `subagents` (the subagents host) ends the sessions of children:
  `session_end` on a child's name (`<parent>.<id>`), nothing else. It holds
  the key that mints every child's credential, so it could act as any child
  anyway; what it actually sends is `session_end` when a child exited;
- `operator` (a connection holding the operator credential that names itself
  `operator` at the broker; the name is reserved, no other credential can take
  it) acts on any session, as it may do anything else.

Everything else is refused with `forbidden`. MCP requests name no session:
procs keys them by the sender itself (actors/procs/mcpbridge.py).
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
