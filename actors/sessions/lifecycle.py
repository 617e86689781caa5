"""Which session an agent process runs: the one decision made at each step
before anything else (docs/sessions.md, "A new session or a resumed one").

`supervisor run` and `spawn` write a fresh session id into the agent's spec
each time they start it (`AgentSpec.session`). The agent, having folded its
stream (the fold is the newest session's), starts that session when

- the stream holds no session yet (a new agent; an id is minted when the
  spec names none), or
- its newest session is over (finished, or closed at a bound) and the spec
  names a later session id (ids sort by creation time).

A session that is not over (stopped, killed, paused on its budget) is
resumed as a new run segment whatever the spec names, and a restart by the
supervisor's policy (the same spec) never begins a second session. The
segment records the spec's id it went on under (`session_start`'s
`spec_session`), so that id never begins a session once this one is over:
a spawn over an open session resumes it, and only it.
"""

from __future__ import annotations

from actors.kernel.state import AgentState
from actors.sessions.ids import is_session_id, new_session_id


def session_to_start(state: AgentState, wanted: str | None) -> str | None:
    """The id of the session to begin now, or None to go on with the current one."""
    if state.session is None:
        if state.phase != "new":
            return None  # a stream written before sessions existed: it goes on as it is
        return wanted if is_session_id(wanted) else new_session_id()
    if wanted is None or not is_session_id(wanted) or wanted <= state.session:
        return None
    if state.spec_session is not None and wanted <= state.spec_session:
        return None  # the spec that resumed this session while it was open
    return wanted if state.phase in ("finished", "closed") else None
