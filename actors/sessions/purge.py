"""Purging one session: journal, stage, remove, drop the rows.

Each step durable before the next; an interrupted purge is retried or
finished by `supervisor up`. See docs/sessions.md ("Purge").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.kernel import generations
from actors.kernel.effects import session_of_file
from actors.sessions import index
from actors.sessions.ids import (
    STAGING_DIR,
    index_path,
    is_session_id,
    session_dir,
    staging_dir,
)
from broker.durable import fsync_dir

FAULT_ENV = "CORRAL_PURGE_FAULT"  # tests: SIGKILL right after the named step
STEPS = ("journaled", "staged", "files_removed", "done")
MAX_ENTRIES = 100_000


class PurgeRefusedError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Plan:
    session_id: str
    agent: str
    stream: str
    first_seq: int
    last_seq: int
    step: str | None  # the journal's state, None before the purge began
    entries: list[dict[str, Any]] = field(default_factory=list)  # what is still on disk

    def as_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "agent": self.agent, "stream": self.stream,
                "first_seq": self.first_seq, "last_seq": self.last_seq,
                "journal": self.step, "entries": self.entries}


def _fault(step: str) -> None:
    if os.environ.get(FAULT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _generation_files(root: Path, agent: str, session_id: str) -> list[Path]:
    """The agent's generation files that hold this session's state."""
    state = root / "agents" / agent / "state"
    found: list[Path] = []
    candidates = [state / "snapshot.json"]
    with contextlib.suppress(OSError):
        candidates += sorted((state / "generations").iterdir())
    for path in candidates:
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > 64 << 20:
                continue
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        inner = data.get("state") if isinstance(data, dict) else None
        if isinstance(inner, dict) and inner.get("session") == session_id:
            found.append(path)
    return found


def _effect_files(root: Path, agent: str, session_id: str) -> list[Path]:
    """The agent's effect journal entries of this session (actors/kernel/effects.py)."""
    directory = root / "agents" / agent / "effects"
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [directory / name for name in names if session_of_file(name) == session_id]


Links = dict[tuple[int, int], int]  # (st_dev, st_ino) -> names of it the purge owns


def _owned_links(paths: list[Path]) -> Links:
    """How many of `paths` name each file: a generation and `snapshot.json`
    are two names of one file (actors/kernel/generations.py), both owned."""
    counts: Links = {}
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            counts[(st.st_dev, st.st_ino)] = counts.get((st.st_dev, st.st_ino), 0) + 1
    return counts


def _walk(top: Path, base: Path, owned: Links | None = None) -> list[dict[str, Any]]:
    """Entries under `top` (itself included), never following a link; refuses
    what a session's files never are (links, devices, a file with a name the
    purge does not own (`owned` counts those it does), another file system)."""
    _no_link_above(top, base)
    try:
        st_top = os.lstat(top)
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    stack = [(top, st_top)]
    while stack:
        path, st = stack.pop()
        rel = str(path.relative_to(base))
        if stat.S_ISLNK(st.st_mode):
            raise PurgeRefusedError("unproved_boundary", f"{rel} is a symbolic link")
        if st.st_dev != st_top.st_dev:
            raise PurgeRefusedError("unproved_boundary", f"{rel} is on another file system")
        if stat.S_ISDIR(st.st_mode):
            out.append({"path": rel, "type": "dir"})
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                stack.append((Path(entry.path), entry.stat(follow_symlinks=False)))
        elif stat.S_ISREG(st.st_mode):
            if st.st_nlink > (owned or {}).get((st.st_dev, st.st_ino), 1):
                raise PurgeRefusedError("unproved_boundary", f"{rel} has other hard links")
            out.append({"path": rel, "type": "file", "bytes": st.st_size})
        else:
            raise PurgeRefusedError("unproved_boundary", f"{rel} is not a file or directory")
        if len(out) > MAX_ENTRIES:
            raise PurgeRefusedError("unproved_boundary", "more entries than a purge takes")
    return sorted(out, key=lambda e: str(e["path"]))


def _no_link_above(top: Path, base: Path) -> None:
    """Refuse when a directory between `base` and `top` is a link (or not a
    directory): a purge never reaches through one."""
    for parent in reversed(top.relative_to(base).parents[:-1]):
        try:
            st = os.lstat(base / parent)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise PurgeRefusedError("unproved_boundary",
                                    f"{parent} is a symbolic link or not a directory")


def _real_dir(path: Path) -> None:
    """`path` made if missing; refused unless it is a directory itself (not a link)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise PurgeRefusedError("unproved_boundary",
                                f"{path.name} is a symbolic link or not a directory")


def _entries(root: Path, plan: Plan) -> list[dict[str, Any]]:
    live = _walk(session_dir(root, plan.session_id), root)
    gens = _generation_files(root, plan.agent, plan.session_id)
    owned = _owned_links(gens)
    for path in [*gens, *_effect_files(root, plan.agent, plan.session_id)]:
        live += _walk(path, root, owned)
    staged = staging_dir(root, plan.session_id)
    _no_link_above(staged, root)
    inside = [Path(top, name) for top, _dirs, files in os.walk(staged) for name in files]
    return live + _walk(staged, root, _owned_links(inside))  # a generation staged twice


def plan_for(root: Path, session_id: str) -> Plan:
    """What a purge of `session_id` (a full id) would do, or is doing."""
    if not is_session_id(session_id):
        raise PurgeRefusedError("not_full_id", f"{session_id!r} is not a full session id")
    conn = index.open_index(root)
    try:
        journal = index.journal_row(conn, session_id)
        if journal is not None:
            if journal["state"] == "done":
                raise PurgeRefusedError("purged", f"session {session_id} is already purged")
            agent = str(journal["stream"]).removeprefix(index.AGENT_PREFIX)
            plan = Plan(session_id, agent, str(journal["stream"]), int(journal["first_seq"]),
                        int(journal["last_seq"]), str(journal["state"]))
        else:
            row = index.session_row(conn, session_id)
            if row is None:
                raise PurgeRefusedError("unknown", f"no session {session_id}")
            plan = Plan(session_id, str(row["agent"]), str(row["stream"]),
                        int(row["first_seq"]), int(row["last_seq"]), None)
    finally:
        conn.close()
    plan.entries = _entries(root, plan)
    return plan


AgentState = Callable[[str], str | None]


def refusal(root: Path, session_id: str, *, agent_state: AgentState
            ) -> PurgeRefusedError | None:
    """Why a session that is not being purged yet may not be: unarchived,
    running (a session not over whose agent's process is live: `agent_state`
    gives the supervisor's state of that process, None when it is stopped or
    nothing supervises it), waiting for the operator."""
    conn = index.open_index(root)
    try:
        row = index.session_row(conn, session_id)
    finally:
        conn.close()
    if row is None:
        return PurgeRefusedError("unknown", f"no session {session_id}")
    if not row["archived"]:
        return PurgeRefusedError("not_archived", f"session {session_id} is not archived: "
                                 f"`supervisor sessions archive {session_id}` first")
    live = agent_state(str(row["agent"])) if row["status"] in ("open", "paused") else None
    if live is not None:
        return PurgeRefusedError("running", f"session {session_id} is not over and its "
                                 f"agent {row['agent']} is {live}: stop it first "
                                 f"(`supervisor stop {row['agent']}`)")
    if int(row["pending_input"]):
        return PurgeRefusedError("pending_input", f"session {session_id} waits for the "
                                 "operator (an unanswered request, or paused on its budget)")
    return None


def purge(root: Path, session_id: str, *, agent_state: AgentState) -> Plan:
    """Purge the session (or finish an interrupted purge of it)."""
    plan = plan_for(root, session_id)
    conn = index.connect(root)
    try:
        if plan.step is None:
            refused = refusal(root, session_id, agent_state=agent_state)
            if refused is not None:
                raise refused
            with index.transaction(conn):
                conn.execute("INSERT INTO purge_journal VALUES(?,?,?,?,?,?,NULL)", (
                    session_id, plan.stream, plan.first_seq, plan.last_seq, "journaled",
                    time.time()))
            plan.step = "journaled"
            _fault("journaled")
        if plan.step == "journaled":
            _stage(root, plan)
            _set_step(conn, session_id, "staged")
            plan.step = "staged"
            _fault("staged")
        if plan.step == "staged":
            _remove_tree(staging_dir(root, session_id))
            _set_step(conn, session_id, "files_removed")
            plan.step = "files_removed"
            _fault("files_removed")
        if plan.step == "files_removed":
            with index.transaction(conn):
                for table in ("segments", "labels", "archive"):
                    conn.execute(f"DELETE FROM {table} WHERE session_id=?",  # noqa: S608
                                 (session_id,))
                conn.execute("DELETE FROM sessions WHERE session_id=?", (session_id,))
                conn.execute("UPDATE purge_journal SET state='done', finished_at=? "
                             "WHERE session_id=?", (time.time(), session_id))
            plan.step = "done"
            _scrub_index(conn)
    finally:
        conn.close()
    plan.entries = []
    return plan


def finish_interrupted(root: Path) -> list[str]:
    """Finish every purge stopped before `done` (run by `supervisor up` before
    any agent starts); returns the ids finished. One that cannot be finished
    now is left for the next try (the operator's retry says why)."""
    if not index_path(root).exists():
        return []
    conn = index.connect(root)
    try:
        pending = [str(r[0]) for r in conn.execute(
            "SELECT session_id FROM purge_journal WHERE state!='done' ORDER BY session_id")]
    finally:
        conn.close()
    done = []
    for session_id in pending:
        with contextlib.suppress(PurgeRefusedError, OSError, sqlite3.Error):
            purge(root, session_id, agent_state=lambda _agent: None)
            done.append(session_id)
    return done


def _set_step(conn: Any, session_id: str, step: str) -> None:
    with index.transaction(conn):
        conn.execute("UPDATE purge_journal SET state=? WHERE session_id=?", (step, session_id))


def _stage(root: Path, plan: Plan) -> None:
    """Rename every owned file into the staging directory (redone from what is
    left after a stop: a rename already made is not made again)."""
    staged = staging_dir(root, plan.session_id)
    _real_dir(root / STAGING_DIR)
    _real_dir(staged)
    fsync_dir(root / STAGING_DIR)
    moves: list[tuple[Path, Path]] = []
    live = session_dir(root, plan.session_id)
    if os.path.lexists(live):
        _walk(live, root)  # refuses a link or a foreign entry before anything moves
        moves.append((live, staged / "session"))
    gens = staged / "generations"
    owned_gens = _generation_files(root, plan.agent, plan.session_id)
    owned = _owned_links(owned_gens)
    for path in owned_gens:
        _walk(path, root, owned)  # no name of it outside what the purge owns
        _real_dir(gens)
        moves.append((path, gens / path.name))  # gen-<seq>.json, snapshot.json: distinct
    effects = staged / "effects"
    for path in _effect_files(root, plan.agent, plan.session_id):
        _walk(path, root)  # a regular file with one link, or refused before it moves
        _real_dir(effects)
        moves.append((path, effects / path.name))
    for source, target in moves:
        os.rename(source, target)
        _fault("staging")
        fsync_dir(source.parent)
    fsync_dir(staged)
    for made in (gens, effects):
        if made.exists():
            fsync_dir(made)
    _repoint_snapshot(root / "agents" / plan.agent)


def _repoint_snapshot(agent_dir: Path) -> None:
    """`snapshot.json` names the newest generation left, or nothing: derived,
    never read for recovery (actors/kernel/generations.py), so a staged purge
    that took it leaves the agent as sound as one that never had it."""
    snapshot = generations.state_dir_of(agent_dir) / "snapshot.json"
    if os.path.lexists(snapshot):
        return  # another session's: the purge did not take it
    left = generations.list_generations(agent_dir)
    if left:
        generations.refresh_snapshot(left[-1], snapshot)


def _remove_tree(top: Path) -> None:
    """Remove `top` (`purge-staging/<id>`) and everything in it, through
    directory fds opened with O_NOFOLLOW from `purge-staging` down: a link is
    unlinked itself, never followed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        parent = os.open(top.parent, flags)
    except FileNotFoundError:
        return
    except OSError as exc:  # ELOOP/ENOTDIR: purge-staging is a link or a file
        raise PurgeRefusedError("unproved_boundary",
                                f"{top.parent.name} is a symbolic link or not a directory"
                                ) from exc
    try:
        try:
            fd = os.open(top.name, flags, dir_fd=parent)
        except FileNotFoundError:
            return
        try:
            _empty_dir(fd)
        finally:
            os.close(fd)
        os.rmdir(top.name, dir_fd=parent)
        os.fsync(parent)
    finally:
        os.close(parent)


def _scrub_index(conn: Any) -> None:
    """The index file holds none of the purged rows' bytes: rebuilt without
    its free pages (VACUUM) and its SQLite WAL emptied into it."""
    conn.execute("VACUUM")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _empty_dir(fd: int) -> None:
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                _empty_dir(child)
            finally:
                os.close(child)
            os.rmdir(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
            _fault("removing")
    os.fsync(fd)
