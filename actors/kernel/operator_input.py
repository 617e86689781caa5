"""Operator input that reaches the model: clarification answers and corrections.

Owns the input files (text outside the WAL) and both halves: `record_*` (the
CLI) and `consume` / `texts` (the loop). See docs/operator-input.md.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from broker.durable import write_atomic

INPUT_DIR = "input"
MAX_TEXT_CHARS = 64_000
FILE_PATTERN = re.compile(r"^(answer|correction)-[A-Za-z0-9][A-Za-z0-9_.\-]{0,80}\.txt$")
CONSUMED_EVENT = {"answer": "clarification_consumed", "correction": "correction_consumed"}


class InputRefusedError(ValueError):
    """An answer or a correction the operator may not give now (unknown or
    settled request, a permission request, a finished session, one pending)."""


@dataclass(frozen=True)
class Delivered:
    """One operator input given to the model with a request."""

    kind: str  # "answer" | "correction"
    ident: str  # the request ("req-3.0") or the correction ("k1")
    text: str
    sha256: str


class _Appender(Protocol):
    def append(self, stream: str, event: str, payload: Any, *, key: str,
               ledger: Any = None) -> Any: ...


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def input_dir(agent_dir: Path) -> Path:
    return agent_dir / INPUT_DIR


def check_text(text: str) -> str:
    if not text.strip():
        raise InputRefusedError("the text is empty")
    if len(text) > MAX_TEXT_CHARS:
        raise InputRefusedError(f"the text has {len(text)} characters; at most {MAX_TEXT_CHARS}")
    if "\x00" in text:
        raise InputRefusedError("the text holds a NUL character")
    return text


def write_text(agent_dir: Path, kind: str, ident: str, text: str) -> dict[str, Any]:
    """Write the exact text durably; returns the reference the WAL fact carries."""
    sha = digest(text)
    name = f"{kind}-{ident}-{sha[:12]}.txt"
    if not FILE_PATTERN.fullmatch(name):
        raise InputRefusedError(f"invalid identity {ident!r}")
    directory = input_dir(agent_dir)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(directory / name, text.encode())
    except OSError as exc:  # a full disk (ENOSPC, EDQUOT) or a broken directory
        raise InputRefusedError(
            f"cannot write the text under {directory}: {exc.strerror or exc}; nothing was "
            f"recorded, run the command again once that is fixed") from exc
    return {"sha256": sha, "chars": len(text), "file": name}


def read_text(agent_dir: Path, file: str, sha256: str) -> str:
    """The text a WAL fact names, checked against its hash. A missing, renamed or
    altered file gives a placeholder the model can read (never an exception)."""
    if not FILE_PATTERN.fullmatch(file):
        return f"[operator input unavailable: invalid file name {file[:80]!r}]"
    try:
        fd = os.open(input_dir(agent_dir) / file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return f"[operator input unavailable: {exc.strerror or type(exc).__name__}]"
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_TEXT_CHARS * 4 + 1)
    text = data.decode("utf-8", errors="replace")
    if digest(text) != sha256:
        return "[operator input unavailable: the file does not match its recorded hash]"
    return text


def _branch(state: Any) -> str:
    """The active branch's key prefix ("" before any rewind; actors/trees/branch.py):
    after a rewind, a question asked again under the same request id, or the
    next correction under a reused id, is a new input, not a duplicate of the
    abandoned one."""
    return str(getattr(state, "branch", "") or "")


def _scoped(state: Any, key: str) -> str:
    """Requests and corrections are numbered afresh in each session: the key
    names the session (docs/sessions.md)."""
    session = getattr(state, "session", None)
    return f"{session}.{key}" if isinstance(session, str) else key


def record_answer(writer: _Appender, agent_dir: Path, agent: str, state: Any, request: str,
                  *, text: str) -> str:
    """The operator's answer to a pending clarification: file, then the WAL fact.
    Raises InputRefusedError for an unknown, settled or permission request."""
    approval = state.approvals.get(request)
    if approval is None:
        waiting = [a.request for a in state.pending_approvals() if a.kind == "clarification"]
        raise InputRefusedError(f"agent {agent} has no question {request} "
                                f"(pending questions: {', '.join(waiting) or 'none'})")
    if approval.kind != "clarification":
        raise InputRefusedError(f"{request} of {agent} asks a permission, not a question: "
                                "use `supervisor approve` or `deny` (an answer never grants)")
    if approval.status != "pending":
        raise InputRefusedError(f"question {request} of {agent} is already {approval.status}")
    ref = write_text(agent_dir, "answer", request, check_text(text))
    ok = writer.append(f"agent/{agent}", "operator_answer", {"request": request, **ref},
                       key=_scoped(state, f"answer:{agent}:{_branch(state)}{request}"),
                       ledger="approvals")
    if getattr(ok, "duplicate", False):
        raise InputRefusedError(f"question {request} of {agent} was answered already")
    return f"answered {agent} {request} ({ref['chars']} characters, sha256 {ref['sha256'][:12]})"


def record_correction(writer: _Appender, agent_dir: Path, agent: str, state: Any,
                      text: str) -> str:
    """One pending correction for the agent's next model request. Refused on a
    finished session and while an earlier correction is still pending."""
    if state.phase in ("finished", "closed"):
        raise InputRefusedError(f"agent {agent}'s session is {state.phase} "
                                f"({state.exit_reason or 'over'}): a correction would never "
                                "reach a model; nothing was recorded")
    pending = [i for i in state.inputs if i.kind == "correction" and i.consumed_turn is None]
    if pending:
        raise InputRefusedError(f"agent {agent} already has correction {pending[0].ident} "
                                "pending (it reaches the model at its next request); "
                                "nothing was recorded")
    ident = f"k{state.corrections + 1}"
    ref = write_text(agent_dir, "correction", ident, check_text(text))
    ok = writer.append(f"agent/{agent}", "operator_correction",
                       {"correction": ident, "segment": state.segment, **ref},
                       key=_scoped(state, f"correct:{agent}:{_branch(state)}{ident}"))
    if getattr(ok, "duplicate", False):
        raise InputRefusedError(f"another correction {ident} of {agent} was recorded at the "
                                "same time; nothing was recorded")
    return (f"correction {ident} for {agent} recorded ({ref['chars']} characters, sha256 "
            f"{ref['sha256'][:12]}): delivered at its next model request")


def consumption(kind: str, ident: str, sha256: str, turn: int, segment: int
                ) -> tuple[str, dict[str, Any], str]:
    """(event, payload, key) of the fact that spends an input on model turn `turn`."""
    field = "request" if kind == "answer" else "correction"
    payload = {field: ident, "sha256": sha256, "turn": turn, "segment": segment,
               "delivery": "live"}
    # the text's hash in the key: a consumption written before the input existed
    # (only the agent's own credential could) cannot shadow the real one
    return CONSUMED_EVENT[kind], payload, f"t{turn}:in:{kind}:{ident}:{sha256[:16]}"


def texts(agent_dir: Path, state: Any, turn: int) -> list[Delivered]:
    """The inputs consumed for model turn `turn`, with their exact texts."""
    return [Delivered(i.kind, i.ident, read_text(agent_dir, i.file, i.sha256), i.sha256)
            for i in state.inputs if i.consumed_turn == turn]


def consume(state: Any, turn: int, append: Any, flush: Any, hit: Any) -> None:
    """Spend every pending input on model turn `turn`: one consumption fact each,
    appended and flushed (durable) before the request that carries them. `hit`
    is the fault hook (actors/agent/faults.py) around it."""
    pending = [i for i in state.inputs if i.consumed_turn is None]
    if not pending:
        return
    hit("before_input_consumed", f"t{turn}")
    for item in pending:
        event, payload, key = consumption(item.kind, item.ident, item.sha256, turn,
                                          state.segment)
        append(event, payload, key)
    flush()
    hit("after_input_consumed", f"t{turn}")
