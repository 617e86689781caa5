"""Transcripts: a session's exact model requests and responses, a line per call.

See docs/sessions.md ("Transcripts").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import structlog

from actors.kernel.reply import Backend, Reply
from actors.kernel.state import AgentState
from actors.kernel.vault import is_refused, is_sealed, strings_in
from actors.sessions.ids import session_dir
from broker.durable import fsync_dir

log = structlog.get_logger("transcript")

CURRENT = "transcript.jsonl"
MIN_REFUSED_CHARS = 4  # shorter strings of a refused secret field stay (they would mangle the line)


def segment_file(directory: Path, segment: int) -> Path:
    return directory / f"transcript.pre_seg_{segment}.jsonl"


def _secrets(raw: list[Any], sealed: list[Any]) -> list[tuple[str, str]]:
    """(secret text, its seal's printed form) for every field the vault sealed."""
    found: list[tuple[str, str]] = []
    for before, after in zip(raw, sealed, strict=False):
        if not (isinstance(before, dict) and isinstance(after, dict)):
            continue
        for key, value in after.items():
            text = before.get(key)
            if is_sealed(value) and isinstance(text, str) and text:
                found.append((text, f"<sealed sha256:{value['sha256']} {value['bytes']} bytes>"))
            elif is_refused(value):  # a secret field sent as a list or object: its strings
                found += [(s, "<refused>") for s in strings_in(text) if len(s) >= MIN_REFUSED_CHARS]
    return found


def seal_text(line: str, secrets: list[tuple[str, str]]) -> str:
    """`line` (JSON text) with every spelling of each secret replaced: as a JSON
    string, escaped once more inside a JSON string (tool-call arguments), ASCII
    or not."""
    for text, seal in sorted(secrets, key=lambda s: -len(s[0])):
        once = [json.dumps(text, ensure_ascii=a)[1:-1] for a in (False, True)]
        twice = [json.dumps(o, ensure_ascii=a)[1:-1] for o in once for a in (False, True)]
        for spelling in sorted(set(twice + once), key=len, reverse=True):
            line = line.replace(spelling, seal)
    return line


class Transcript:
    """The transcript files of one agent's sessions."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def begin_segment(self, session: str | None, segment: int) -> None:
        """Keep the previous segment's file under its numbered name."""
        if session is None:
            return
        directory = session_dir(self.root, session)
        current = directory / CURRENT
        try:
            with open(current, "rb") as f:
                first = json.loads(f.readline() or b"{}")
        except FileNotFoundError:
            return
        except ValueError:
            first = {}
        previous = first.get("segment") if isinstance(first, dict) else None
        if previous == segment:
            return
        number = previous if type(previous) is int else 0
        target = segment_file(directory, number)
        while target.exists():  # never overwrite an earlier segment's record
            number += 1
            target = segment_file(directory, number)
        os.rename(current, target)
        fsync_dir(directory)

    def record(self, state: AgentState, turn: int, backend: Backend, reply: Reply,
               sealed_actions: list[Any]) -> None:
        """Append one model call (request and response), its secrets sealed."""
        if state.session is None:
            return
        request = getattr(backend, "last_request", None)
        response = getattr(backend, "last_response", None)
        entry = {
            "ts": round(time.time(), 6), "session": state.session, "segment": state.segment,
            "turn": turn, "backend": backend.name,
            "request": request if request is not None else {
                "cursor": state.cursor, "model_calls": state.model_calls},
            "response": response if response is not None else {
                "actions": reply.actions, "text": reply.text, "usage": reply.usage.as_dict()},
        }
        line = seal_text(json.dumps(entry, ensure_ascii=False, default=str),
                         _secrets(reply.actions, sealed_actions))
        directory = session_dir(self.root, state.session)
        try:
            created = False
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            try:
                fd = os.open(directory / CURRENT, flags, 0o600)
            except FileNotFoundError:  # the session's first line: its directory too
                created = not directory.exists()
                directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(directory / CURRENT, flags, 0o600)
            try:
                os.write(fd, line.encode("utf-8", "surrogatepass") + b"\n")
                if request is not None:  # a request that left the process: see the docstring
                    os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                fsync_dir(directory)
                fsync_dir(directory.parent)
        except OSError as exc:  # an audit record never stops the session (a full disk)
            log.error("transcript_write_failed", session=state.session, turn=turn,
                      error=exc.strerror or type(exc).__name__)
