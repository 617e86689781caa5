"""Helpers for the storage tests: a writer with small segments, the purge
journal as `sessions` writes it, and a `gc` request answered by the writer."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import uuid

import zmq

from actors.writer.client import WriterClient
from actors.writer.walgc import REQUEST_NAME, RESULT_NAME
from broker.durable import write_atomic
from broker.errors import RequestTimeoutError
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for

Ctx = zmq.Context[zmq.Socket[bytes]]


def start_writer(processes: ProcessTracker, sd: StateDir, ctx: Ctx, name: str = "writer",
                 *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = processes.spawn(
        ["-m", "actors.writer", "--state-dir", str(sd.root), "--segment-bytes", "4096",
         "--gc-interval-s", "3600", *extra],
        name=name, env=env,
    )
    probe = WriterClient(ctx, sd, "probe", storage_wait_s=0)

    def answered() -> bool:
        assert proc.poll() is None, processes.output(name)
        try:
            probe.ping(timeout_s=0.1, retries=0)
        except RequestTimeoutError:
            return False
        return True

    try:
        wait_for(answered, 20, "the writer to answer")
    finally:
        probe.close()
    return proc


def purge(sd: StateDir, session_id: str, stream: str, first: int, last: int, *,
          state: str = "done") -> None:
    """A row of the purge journal, as the sessions engineer's contract has it."""
    con = sqlite3.connect(sd.root / "sessions.sqlite3")
    try:
        con.execute(
            "CREATE TABLE IF NOT EXISTS purge_journal(session_id TEXT PRIMARY KEY, "
            "stream TEXT NOT NULL, first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, "
            "state TEXT NOT NULL, started_at REAL, finished_at REAL)"
        )
        con.execute("INSERT OR REPLACE INTO purge_journal VALUES (?, ?, ?, ?, ?, 0, 0)",
                    (session_id, stream, first, last, state))
        con.commit()
    finally:
        con.close()


def request_gc(sd: StateDir, dry_run: bool = False) -> str:
    request_id = uuid.uuid4().hex
    write_atomic(sd.run_dir / REQUEST_NAME,
                 json.dumps({"id": request_id, "dry_run": dry_run}).encode())
    return request_id


def gc_result(sd: StateDir, request_id: str) -> dict[str, object] | None:
    try:
        data = json.loads((sd.run_dir / RESULT_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("id") == request_id else None


def run_gc(sd: StateDir, dry_run: bool = False, timeout_s: float = 20) -> dict[str, object]:
    request_id = request_gc(sd, dry_run)
    result: dict[str, object] = wait_for(lambda: gc_result(sd, request_id), timeout_s,
                                         "the writer's gc pass")
    return result


def grep_tree(sd: StateDir, marker: bytes) -> list[str]:
    """Every file under the state directory (names included) holding `marker`,
    but the purge journal itself (sessions' table: its row names the purged
    stream by contract)."""
    found = []
    for path in sd.root.rglob("*"):
        if path.name.startswith("sessions.sqlite3"):
            continue
        named = marker in str(path).encode()
        if named or (path.is_file() and not path.is_symlink() and marker in path.read_bytes()):
            found.append(str(path))
    return found
