"""The subagents registry: `<state>/subagents/registry.json` (version 1).

Written durably before a child's start gate opens; what a restart resumes.
See docs/changesets.md ("The host and the ops").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from broker.durable import write_atomic

if TYPE_CHECKING:
    from actors.changesets.manifest import Limits
    from broker.peer import BrokerPeer
    from broker.statedir import StateDir

VERSION = 1
ChildState = Literal["running", "exited", "ended", "failed", "applied"]


@dataclass
class ChildRecord:
    subagent_id: str
    parent: str
    name: str  # the child's actor name: <parent>.<subagent_id>
    directory: str  # <parent session dir>/subagents/<id>/
    workspace: str  # the parent's workspace (where an apply writes)
    task: str
    state: ChildState = "running"
    pid: int | None = None
    exit_code: int | None = None
    starts: int = 0
    tokens_used: int = 0
    cost_used: float = 0.0
    # a child on another host (actors/subagents/remote.py): on the parent's host,
    # `host` (where it runs), `accepted` (that host took it), `base_sha256` (of the
    # snapshot sent); on the child's host, `origin` (the parent's host) and
    # `remote_id` (the id the parent's host gave it); `refusal`: why it failed
    host: str | None = None
    accepted: bool = False
    base_sha256: str | None = None
    origin: str | None = None
    remote_id: str | None = None
    refusal: str | None = None


class Children:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, ChildRecord] = {}

    @classmethod
    def load(cls, path: Path) -> Children:
        children = cls(path)
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            return children
        if raw.get("version") != VERSION:
            raise ValueError(f"{path}: version {raw.get('version')!r}, expected {VERSION}")
        for item in raw["children"]:
            record = ChildRecord(**item)
            children.records[record.subagent_id] = record
        return children

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"version": VERSION,
                           "children": [asdict(r) for r in self.records.values()]}).encode()
        write_atomic(self.path, body)


class ChildHost(Protocol):
    """What the remote end (actors/subagents/remote.py) uses of the host that
    owns it (actors/subagents/host.py), so that neither imports the other."""

    state: StateDir
    peer: BrokerPeer
    limits: Limits
    children: Children
    counts: dict[str, int]

    def record(self, parent: str, event: str, payload: dict[str, Any], key: str) -> None: ...

    def start_child(self, child: ChildRecord) -> None: ...
