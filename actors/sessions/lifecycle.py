"""Which session an agent process runs: a new one, or the open one resumed.

A spec's session id that went on an open session (`spec_session`) never
begins a session of its own. See docs/sessions.md ("A new session or a
resumed one").
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
