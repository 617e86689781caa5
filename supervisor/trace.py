"""`supervisor trace AGENT [-f] [--since SEQ] [--json]`: a session, readable.

See docs/supervisor.md ("Trace").
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import zmq

from actors.sessions.purged import purged_of, visible
from actors.writer.client import WriterClient
from actors.writer.wal import TornTail, WalRecord, iter_segment, list_segments
from broker.errors import CorralError
from broker.pidlock import is_held
from broker.statedir import StateDir
from supervisor.tracetrees import abandoned_of, tree_lines

FOLLOW_INTERVAL_S = 0.25
ARG_CHARS = 120
RESULT_CHARS = 400
INPUT_EVENTS = frozenset({"operator_answer", "operator_correction"})
PAGE = 512


class TraceError(Exception):
    """The stream cannot be read (the reason is the message)."""


# --- reading ------------------------------------------------------------------------
class SegmentReader:
    """The stream's records straight from the WAL segments, read-only. Remembers
    where it stopped, so following rescans only what was appended since."""

    def __init__(self, state_dir: StateDir, stream: str) -> None:
        self.wal_dir = state_dir.wal_dir
        self.stream = stream
        self._segment: int | None = None  # first seq of the segment being read
        self._offset = 0

    def read(self, from_seq: int) -> list[WalRecord]:
        segments = list_segments(self.wal_dir)
        if self._segment is None or self._segment not in {s for s, _ in segments}:
            # start in the last segment whose first seq is <= from_seq
            start = [s for s, _ in segments if s <= from_seq]
            self._segment = start[-1] if start else (segments[0][0] if segments else None)
            self._offset = 0
        out: list[WalRecord] = []
        for first, path in segments:
            if self._segment is None or first < self._segment:
                continue
            if first > self._segment:
                self._segment, self._offset = first, 0
            try:
                for offset, record in iter_segment(path, self._offset):
                    if isinstance(record, TornTail):
                        return out  # incomplete: shown once the writer finishes it
                    self._offset = offset + len(record.line)
                    if record.stream == self.stream and record.seq >= from_seq:
                        out.append(record)
            except (OSError, CorralError) as exc:
                raise TraceError(f"cannot read {path}: {exc}") from exc
        return out


class WriterReader:
    """The stream's durable records through the writer's `read_stream` pages."""

    def __init__(self, state_dir: StateDir, stream: str) -> None:
        self.stream = stream
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._client = WriterClient(self._ctx, state_dir, "operator-trace", timeout_s=2.0,
                                    retries=1)

    def read(self, from_seq: int) -> list[WalRecord]:
        return list(self._client.read_stream(self.stream, from_seq, PAGE))

    def close(self) -> None:
        self._client.close()
        self._ctx.destroy(linger=0)


class Source:
    """The writer while it runs and answers, else the segments."""

    def __init__(self, state_dir: StateDir, stream: str) -> None:
        self.state_dir = state_dir
        self.stream = stream
        self.segments = SegmentReader(state_dir, stream)
        self.writer: WriterReader | None = None
        self.used = "segments"

    def _writer_up(self) -> bool:
        return is_held(self.state_dir.run_dir / "writer.lock")

    def read(self, from_seq: int) -> list[WalRecord]:
        if self._writer_up():
            try:
                if self.writer is None:
                    self.writer = WriterReader(self.state_dir, self.stream)
                records = self.writer.read(from_seq)
            except CorralError:
                self.close()  # no answer (restarting, or refusing us): the files
            else:
                self.used = "writer"
                return records
        self.used = "segments"
        return self.segments.read(from_seq)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# --- rendering ----------------------------------------------------------------------
# what the model wrote reaches the operator's terminal: no escape sequences
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def _sealed(value: object) -> bool:
    return isinstance(value, dict) and set(value) == {"sha256", "bytes"}


def value_text(value: object, limit: int = ARG_CHARS) -> str:
    """A payload value in one bounded line; sealed input stays sealed."""
    if _sealed(value):
        assert isinstance(value, dict)
        return f"<sealed {value['bytes']} bytes sha256:{str(value['sha256'])[:12]}>"
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {value_text(v, limit)}" for k, v in value.items()) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(value_text(v, limit) for v in value) + "]"
    else:
        text = json.dumps(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} chars)"
    return text


def _action(action: object) -> str:
    if not isinstance(action, dict):
        return f"(not an object) {value_text(action)}"
    op = action.get("op", "?")
    args = ", ".join(f"{k}={value_text(v)}" for k, v in action.items() if k != "op")
    return f"{op}({args})"


def _effect(effect: object) -> str:
    if not isinstance(effect, dict):
        return ""
    before = str(effect.get("before_sha") or "none")[:8]
    after = str(effect.get("after_sha") or "none")[:8]
    return f" writes {effect.get('path')} ({before} -> {after})"


def _lines(event: str, p: dict[str, Any]) -> list[str]:
    cid = p.get("call_id", "")
    match event:
        case "session_started":
            return [f"SESSION {p.get('session')} (number {p.get('number')}, previous "
                    f"{p.get('previous') or '-'})"]
        case "session_start":
            how = "resumed" if p.get("resumed") else "started"
            return [f"session {p.get('segment')} {how}: task {p.get('task')}, "
                    f"backend {p.get('backend')}, max {p.get('max_turns')} turns"]
        case "session_exit":
            extra = " (resumable: `supervisor resume`)" if p.get("resumable") else ""
            head = {"budget": "BUDGET STOP", "max_turns": "MAX TURNS"}.get(
                str(p.get("reason")), str(p.get("reason")))
            line = f"session exit: {head} at turn {p.get('turn')}{extra}"
            if p.get("summary"):
                line += f": {value_text(p['summary'], RESULT_CHARS)}"
            return [line]
        case "turn":
            usage = p.get("usage") or {}
            lines = [f"turn {p.get('turn')} ({p.get('backend')}, "
                     f"{usage.get('tokens_in', 0)}+{usage.get('tokens_out', 0)} tokens)"]
            if p.get("text"):
                lines.append(f"  model: {value_text(p['text'], RESULT_CHARS)}")
            actions = p.get("actions") or []
            for index, action in enumerate(actions if isinstance(actions, list) else []):
                lines.append(f"  action {p.get('turn')}.{index}: {_action(action)}")
            return lines
        case "tool_call":
            return [f"  call {cid}: {p.get('op') or '(invalid action)'}"]
        case "schema_reject":
            return [f"  call {cid}: REJECTED {p.get('op')}: {value_text(p.get('errors'))}"]
        case "permission":
            line = f"  call {cid}: {p.get('op')} -> {str(p.get('decision')).upper()}"
            line += f" (rule {p.get('rule')})"
            if p.get("reason"):
                line += f": {p['reason']}"
            if p.get("request"):
                line += f" [{p['request']}]"
            return [line]
        case "approval_requested":
            what = (f"asks the operator: {value_text(p.get('question'))}"
                    if p.get("kind") == "clarification"
                    else f"asks approval for {p.get('op')} on {p.get('pattern')}")
            return [f"  {p.get('request')}: {what}"]
        case "approval_answer":
            line = f"  {p.get('request')}: operator answered {str(p.get('decision')).upper()}"
            if p.get("always"):
                line += f" (always: {p.get('op')} on {p.get('pattern')})"
            if p.get("note"):
                line += f", note {value_text(p['note'])}"
            return [line]
        case "operator_answer":
            return [f"  {p.get('request')}: operator ANSWERED ({p.get('chars')} characters, "
                    f"sha256 {str(p.get('sha256'))[:12]})"]
        case "operator_correction":
            return [f"CORRECTION {p.get('correction')} by the operator ({p.get('chars')} "
                    f"characters, sha256 {str(p.get('sha256'))[:12]})"]
        case "clarification_consumed" | "correction_consumed":
            what = str(p.get("request") or p.get("correction"))
            return [f"  {what}: delivered to the model with turn {p.get('turn')}"]
        case "tool_start":
            return [f"  call {cid}: start {p.get('op')}{_effect(p.get('effect'))}"]
        case "tool_result":
            result = p.get("result")
            if isinstance(result, dict) and "subagent_id" in result:
                return _subagent_result(cid, p, result)
            return [f"  call {cid}: {p.get('op')} {str(p.get('status')).upper()}: "
                    f"{value_text(result, RESULT_CHARS)}"]
        case "turn_aborted":
            calls = p.get("calls") or []
            applied: dict[object, str] = {True: "applied", False: "not applied"}
            found = "; ".join(
                f"{c.get('call_id')} {c.get('op')} effect "
                f"{applied.get(c.get('effect_applied'), 'unknown')}"
                for c in calls if isinstance(c, dict))
            return [f"turn {p.get('turn')} ABORTED ({p.get('reason')}): {found or 'no calls'}"]
        case "budget_resumed":
            return [f"budget resumed by the operator: +{p.get('tokens')} tokens, "
                    f"+{p.get('cost_units')} cost units"]
        case "subagent_usage":
            return [f"  subagent {p.get('subagent_id')} used {p.get('tokens')} tokens, "
                    f"{p.get('cost_units')} cost units"]
        case "todos":
            items = p.get("items") or []
            done = sum(1 for i in items if isinstance(i, dict) and i.get("done"))
            return [f"  todos: {done}/{len(items)} done"]
        case "workspace_tree" | "rewind" | "session_fork":
            return tree_lines(event, p)
        case _:
            return [f"  {event}: {value_text(p, RESULT_CHARS)}"]


def _subagent_result(cid: object, p: dict[str, Any], r: dict[str, Any]) -> list[str]:
    """A subagent op's result: its state and its change set (files, patch size)."""
    head = (f"  call {cid}: {p.get('op')} {str(p.get('status')).upper()}: subagent "
            f"{r.get('subagent_id')} {r.get('state')}")
    if r.get("exit_code") is not None:
        head += f" (exit {r['exit_code']})"
    lines = [head]
    files = r.get("files")
    if isinstance(files, list):
        names = ", ".join(f"{f.get('op')} {f.get('path')}" for f in files[:20]
                          if isinstance(f, dict))
        more = f" (+{len(files) - 20} more)" if len(files) > 20 else ""
        lines.append(f"    change set {r.get('status')}: {len(files)} files, "
                     f"{r.get('patch_bytes')} patch bytes: {names or 'none'}{more}")
    if r.get("applied"):
        lines.append("    applied to the workspace")
    if r.get("error") or r.get("refusal"):
        lines.append(f"    refused: {value_text(r.get('error') or r.get('refusal'))}")
    if isinstance(r.get("patch"), str):
        lines.append(f"    patch: {value_text(r['patch'], RESULT_CHARS)}")
    return lines


def _input_text(record: WalRecord, payload: Any, agent_dir: Path | None) -> str | None:
    """An operator input's exact text, from the agent's input file (never the WAL)."""
    if agent_dir is None or record.event not in INPUT_EVENTS or not isinstance(payload, dict):
        return None
    from actors.kernel.operator_input import read_text  # noqa: PLC0415

    return read_text(agent_dir, str(payload.get("file")), str(payload.get("sha256")))


def render(record: WalRecord, abandoned: bool = False, agent_dir: Path | None = None) -> str:
    """The record as text: `#seq HH:MM:SS.mmm ` then its lines (`~` instead of
    `#` for a record a rewind abandoned: off the active branch; with `agent_dir`,
    an operator answer's or correction's exact text from its file)."""
    try:
        payload = record.payload()
    except ValueError:
        payload = None
    when = datetime.fromtimestamp(record.ts).strftime("%H:%M:%S.%f")[:-3]
    if not isinstance(payload, dict):
        body = [f"  {record.event}: (payload is not an object)"]
    else:
        try:
            body = _lines(record.event, payload)
        except (AttributeError, TypeError, ValueError, KeyError):  # a field of another shape
            body = [f"  {record.event}: {value_text(payload, RESULT_CHARS)}"]
    text = _input_text(record, payload, agent_dir)
    if text is not None:
        body.append(f"    text: {value_text(text, RESULT_CHARS)}")
    if record.origin not in ("", record.stream.removeprefix("agent/")) \
            and record.event != "approval_answer":
        body[0] += f"  [by {record.origin}]"
    prefix = f"{'~' if abandoned else '#'}{record.seq:<7} {when} "
    body = [line.translate(_CONTROLS) for line in body]
    return "\n".join([prefix + body[0], *(" " * len(prefix) + line for line in body[1:])])


def as_json(record: WalRecord, abandoned: bool = False, agent_dir: Path | None = None) -> str:
    try:
        payload: Any = record.payload()
    except ValueError:
        payload = None
    out = {"seq": record.seq, "ts": record.ts, "stream": record.stream,
           "event": record.event, "origin": record.origin, "payload": payload}
    text = _input_text(record, payload, agent_dir)
    if text is not None:
        out["text"] = text  # from the agent's input file, not the WAL
    if abandoned:
        out["abandoned"] = True
    return json.dumps(out)


# --- the command --------------------------------------------------------------------
def run(state_dir: StateDir, agent: str, *, since: int, follow: bool, json_out: bool,
        out: TextIO = sys.stdout) -> int:
    stream = f"agent/{agent}"
    source = Source(state_dir, stream)
    next_seq = since
    try:
        batch = source.read(next_seq)
        if not batch and not state_dir.agent_dir(agent).exists():
            if not follow:
                print(f"supervisor: no agent {agent} in {state_dir.root} (no record of "
                      f"{stream})", file=sys.stderr)
                return 1
            print(f"supervisor: no record of {stream} yet; waiting for it", file=sys.stderr)
        while True:
            off = abandoned_of(batch)
            hidden = purged_of(state_dir.root, stream)  # purged sessions: never shown
            for record in batch:
                next_seq = record.seq + 1
                if not visible(record.seq, hidden):
                    continue
                gone = record.seq in off
                agent_dir = state_dir.agent_dir(agent)
                out.write((as_json(record, gone, agent_dir) if json_out
                           else render(record, gone, agent_dir)) + "\n")
            out.flush()
            if not follow:
                return 0
            time.sleep(FOLLOW_INTERVAL_S)  # polling the writer: nothing to wait on
            batch = source.read(next_seq)
    except TraceError as exc:
        print(f"supervisor: trace {agent}: {exc}", file=sys.stderr)
        return 1
    finally:
        source.close()
