"""A self-sufficient bundle: what an agent's newest tree needs beyond its pack.

See docs/fleet.md ("Adoption").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.trees import tree as trees
from actors.trees.store import CorruptObjectError
from actors.writer.wal import list_segments, parse_record

MAX_EXTRA_BYTES = 32 << 20  # extras of one agent per round
TREE_EVENTS = ("workspace_tree", "rewind")
_MARKERS = tuple(f'"event":"{e}"'.encode() for e in TREE_EVENTS)
BUNDLE_SUFFIX = "+bundle"  # the adopter's pack of an agent's extras: `<agent>+bundle.pack`


def tree_named(event: str, payload: object) -> str | None:
    """The workspace a `workspace_tree` or `rewind` record leaves (adopt.cut)."""
    if event not in TREE_EVENTS or not isinstance(payload, dict):
        return None
    digest = payload.get("tree")
    if event == "rewind" and digest is None:
        digest = payload.get("from_tree")  # a rewind to before any tree restores nothing
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    return digest


@dataclass
class NewestTrees:
    """Per agent, the tree its newest tree-bearing record names, read from this
    host's WAL incrementally (only what was appended since the last `read`)."""

    wal_dir: Path
    segment: int = -1  # first seq of the segment read last
    offset: int = 0  # in it, the end of the last complete line read
    newest: dict[str, tuple[int, str]] = field(default_factory=dict)  # agent -> (seq, tree)

    def read(self) -> dict[str, str]:
        for first, path in list_segments(self.wal_dir):
            if first < self.segment:
                continue  # read already
            if first != self.segment:
                self.segment, self.offset = first, 0
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < self.offset:
                        self.offset = 0  # a torn tail cut away and written again: read again
                    f.seek(self.offset)
                    data = f.read(size - self.offset)
            except FileNotFoundError:
                continue  # retention removed it since the listing
            end = data.rfind(b"\n") + 1  # complete lines only: a line being written waits
            for line in data[:end].splitlines(keepends=True):
                if any(m in line for m in _MARKERS):
                    self._see(line)
            self.offset += end
        return {agent: digest for agent, (_, digest) in self.newest.items()}

    def _see(self, line: bytes) -> None:
        record = parse_record(line)
        if record is None or not record.stream.startswith("agent/"):
            return
        try:
            digest = tree_named(record.event, record.payload())
        except ValueError:
            return
        agent = record.stream.removeprefix("agent/")
        if digest is not None and record.seq >= self.newest.get(agent, (0, ""))[0]:
            self.newest[agent] = (record.seq, digest)


@dataclass
class Missing:
    objects: list[tuple[str, bytes]]  # to add to the bundle: (name, bytes checked against it)
    closed: list[str]  # trees whose closure the bundle holds once `objects` are up
    complete: bool  # the whole tree's closure (else: the rest in a later round)


def missing(load: Callable[[str], bytes], root: str, present: set[str], closed: set[str],
            budget: int = MAX_EXTRA_BYTES) -> Missing:
    """The objects of the tree `root` that are not `present`, read with `load`
    (which checks each against its name), skipping `closed` trees; up to
    `budget` bytes. The trees walked are `closed` only when nothing was left out."""
    objects: list[tuple[str, bytes]] = []
    taken: set[str] = set()
    walked: list[str] = []
    size = 0
    complete = True
    todo = [root]
    seen: set[str] = set()
    while todo:
        digest = todo.pop()
        if digest in closed or digest in seen:
            continue
        seen.add(digest)
        try:
            data = load(digest)
            entries, parts = trees.links(data)
        except (CorruptObjectError, trees.TreeFormatError):
            complete = False  # not in this host's store (or damaged): never sent
            continue
        walked.append(digest)
        if digest not in present and digest not in taken:
            objects.append((digest, data))
            taken.add(digest)
            size += len(data)
        todo += parts  # a large directory's parts (actors/trees/tree.py)
        for entry in entries.values():
            if entry.is_dir:
                todo.append(entry.digest)
                continue
            if entry.digest in present or entry.digest in taken:
                continue
            if size + entry.size > budget and objects:
                complete = False  # the rest in the next round
                continue
            try:
                blob = load(entry.digest)
            except CorruptObjectError:
                complete = False
                continue
            objects.append((entry.digest, blob))
            taken.add(entry.digest)
            size += len(blob)
    return Missing(objects, walked if complete else [], complete)
