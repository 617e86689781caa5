"""What `supervisor trace` shows of workspace trees, rewinds and forks.

See docs/trees.md ("Rewind").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.trees import branch
from actors.writer.wal import WalRecord


def abandoned_of(records: Sequence[WalRecord]) -> set[int]:
    events: list[branch.Event] = []
    for r in records:
        try:
            payload = r.payload()
        except ValueError:
            payload = None
        events.append((r.seq, r.event, payload))
    return branch.abandoned(events)


def _short(digest: object) -> str:
    return str(digest)[:12] if digest else "none"


def tree_lines(event: str, p: dict[str, Any]) -> list[str]:
    match event:
        case "workspace_tree":
            return [f"  workspace after turn {p.get('turn')}: tree {_short(p.get('tree'))} "
                    f"({p.get('hashed')} files read)"]
        case "rewind":
            turn = p.get("to_turn")
            at = f" (end of turn {turn})" if turn is not None else ""
            return [f"  REWIND to seq {p.get('to_seq')}{at}: records after it abandoned; "
                    f"workspace tree {_short(p.get('tree'))} (was {_short(p.get('from_tree'))})"]
        case _:
            return [f"  FORKED from {p.get('parent_agent')} at seq {p.get('point_seq')} "
                    f"(turn {p.get('point_turn')}), state sha256 {_short(p.get('source_digest'))}"
                    f", tree {_short(p.get('tree'))}"]
