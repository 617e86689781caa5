"""What the model says, made recordable before the turn is appended.

An action the writer's JSON policy would refuse becomes a stand-in the
catalog rejects, so nothing the model says can make an append fail.
See docs/agents.md ("The loop").
"""

from __future__ import annotations

import re
from typing import Any

from actors.writer.client import encode_payload
from actors.writer.payload import check_payload
from broker.errors import ProtocolError

MAX_OP_NAME_CHARS = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _why_unrecordable(value: Any) -> str | None:
    try:
        check_payload(encode_payload(value))
    except (ValueError, UnicodeError, RecursionError) as exc:
        return type(exc).__name__  # NaN/Infinity, a lone surrogate, runaway nesting
    except ProtocolError as exc:
        return exc.detail
    return None


def _op_name(action: Any) -> str | None:
    op = action.get("op") if isinstance(action, dict) else None
    if not isinstance(op, str) or len(op) > MAX_OP_NAME_CHARS:
        return None
    try:
        op.encode("utf-8")
    except UnicodeError:
        return None
    return op


def recordable_actions(actions: list[Any]) -> list[Any]:
    """`actions` with every one the WAL would refuse replaced by a stand-in."""
    out: list[Any] = []
    for action in actions:
        reason = _why_unrecordable(action)
        out.append(action if reason is None
                   else {"op": _op_name(action), "unrecordable": str(reason)[:200]})
    return out


def recordable_text(text: str) -> str:
    """The model's free text with lone surrogates replaced (U+FFFD)."""
    return _SURROGATE.sub("\ufffd", text)
