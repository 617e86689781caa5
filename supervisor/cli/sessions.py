"""`supervisor sessions ...`: the session index on the command line.

See docs/sessions.md ("Commands").
"""

# ruff: noqa: PLC0415 - each command imports what it needs

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from supervisor.cli.command import Command, Parents

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2
PROG = "supervisor sessions"
MAX_LABEL = 200


def _add(sub: Any, parents: Parents) -> None:
    common = parents.common
    sessions = sub.add_parser("sessions", help="list, show, label, archive, purge sessions")
    verbs = sessions.add_subparsers(dest="verb", required=True, metavar="VERB",
                                    parser_class=type(sessions))

    def verb(name: str, text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = verbs.add_parser(name, parents=[common], help=text)
        return parser

    listing = verb("list", "sessions (not archived unless --all)")
    listing.add_argument("--all", action="store_true", help="archived ones too")
    listing.add_argument("--label", default=None)
    listing.add_argument("--agent", default=None)
    listing.add_argument("--json", action="store_true")
    show = verb("show", "one session: lineage, segments, counts")
    show.add_argument("ref", metavar="REF")
    show.add_argument("--json", action="store_true")
    label = verb("label", "set a session's label")
    label.add_argument("ref", metavar="REF")
    label.add_argument("text")
    for name in ("archive", "unarchive"):
        one = verb(name, f"{name} a session (its files stay)")
        one.add_argument("ref", metavar="REF")
    reindex = verb("reindex", "rebuild the index's derived tables from the WAL")
    reindex.add_argument("--json", action="store_true")
    purge = verb("purge", "remove an archived session's files for good")
    purge.add_argument("session_id", metavar="ID")
    how = purge.add_mutually_exclusive_group(required=True)
    how.add_argument("--preview", action="store_true", help="list what would go; change nothing")
    how.add_argument("--confirm", metavar="ID", help="the same full id again")
    purge.add_argument("--json", action="store_true")


def _fail(message: str, code: int = EXIT_REFUSED) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def run(args: argparse.Namespace) -> int:
    from actors.sessions import index
    from actors.sessions.resolve import SessionRefError
    from broker.statedir import StateDir

    root = StateDir.resolve(args.state_dir).root
    if not root.is_dir():
        return _fail(f"no state directory {root}")
    try:
        return _VERBS[args.verb](root, args)
    except SessionRefError as exc:
        return _fail(str(exc))
    except index.SessionIndexError as exc:
        return _fail(str(exc))


def _list(root: Path, args: argparse.Namespace) -> int:
    from actors.sessions import index

    conn = index.open_index(root)
    try:
        rows = index.list_sessions(conn, include_archived=args.all, label=args.label,
                                   agent=args.agent)
    finally:
        conn.close()
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return EXIT_OK
    print(f"{'SESSION':<26}  {'AGENT':<16} {'STATUS':<9} {'SEG':>3} {'TURNS':>5} "
          f"{'CREATED':<19}  LABEL")
    for r in rows:
        mark = " (archived)" if r["archived"] else ""
        print(f"{r['session_id']:<26}  {r['agent'][:16]:<16} {r['status']:<9} "
              f"{r['segments']:>3} {r['turns']:>5} {_when(r['created_at']):<19}  "
              f"{r['label'] or ''}{mark}")
    return EXIT_OK


def _show(root: Path, args: argparse.Namespace) -> int:
    from actors.sessions import index
    from actors.sessions.resolve import resolve_in

    conn = index.open_index(root)
    try:
        found = resolve_in(conn, args.ref)
        row = index.session_row(conn, found.session_id)
        assert row is not None
        row["segment_list"] = index.segments_of(conn, found.session_id)
        row["children"] = [str(r[0]) for r in conn.execute(
            "SELECT session_id FROM sessions WHERE parent_session=? ORDER BY session_id",
            (found.session_id,))]
    finally:
        conn.close()
    if args.json:
        print(json.dumps(row, sort_keys=True))
        return EXIT_OK
    for key in ("session_id", "agent", "stream", "number", "status", "exit_reason",
                "parent_session", "parent_agent", "previous", "label", "turns", "tool_calls",
                "events", "tokens", "pending_input", "first_seq", "last_seq"):
        print(f"{key:<15} {row.get(key) if row.get(key) is not None else '-'}")
    print(f"{'created':<15} {_when(row['created_at'])}")
    print(f"{'archived':<15} {_when(row['archived_at'])}")
    print(f"{'children':<15} {' '.join(row['children']) or '-'}")
    for seg in row["segment_list"]:
        print(f"segment {seg['segment']:<7} #{seg['seq']} {_when(seg['ts'])} {seg['reason'] or ''}")
    return EXIT_OK


def _label(root: Path, args: argparse.Namespace) -> int:
    from actors.sessions import index
    from actors.sessions.resolve import resolve_in

    text = args.text.strip()
    if not text or len(text) > MAX_LABEL or not text.isprintable():
        return _fail(f"a label is 1 to {MAX_LABEL} printable characters", EXIT_USAGE)
    conn = index.open_index(root)
    try:
        found = resolve_in(conn, args.ref)
        index.set_label(conn, found.session_id, text)
    finally:
        conn.close()
    print(f"{PROG}: labelled {found.session_id} {text!r}")
    return EXIT_OK


def _archive(root: Path, args: argparse.Namespace) -> int:
    from actors.sessions import index
    from actors.sessions.resolve import resolve_in

    archived = args.verb == "archive"
    conn = index.open_index(root)
    try:
        found = resolve_in(conn, args.ref)
        changed = index.set_archived(conn, found.session_id, archived)
    finally:
        conn.close()
    print(f"{PROG}: {found.session_id} {args.verb}d" if changed
          else f"{PROG}: {found.session_id} already {args.verb}d")
    return EXIT_OK


def _reindex(root: Path, args: argparse.Namespace) -> int:
    from actors.sessions import index

    conn = index.reindex(root)
    try:
        count = len(index.list_sessions(conn, include_archived=True))
    finally:
        conn.close()
    print(json.dumps({"ok": True, "sessions": count}) if args.json
          else f"{PROG}: reindexed: {count} sessions")
    return EXIT_OK


def _purge(root: Path, args: argparse.Namespace) -> int:
    from actors.sessions import purge
    from broker.statedir import StateDir
    from supervisor.cli.trees import agent_running

    def live(agent: str) -> str | None:  # the agent's process, when the supervisor runs it
        return agent_running(StateDir(root), agent)

    sid = args.session_id
    try:
        if args.preview:
            plan = purge.plan_for(root, sid)
            if plan.step is None:
                refused = purge.refusal(root, sid, agent_state=live)
                data = plan.as_dict() | {"refused": None if refused is None else
                                         {"reason": refused.reason, "message": str(refused)}}
            else:
                data = plan.as_dict() | {"refused": None}
            if args.json:
                print(json.dumps(data, sort_keys=True))
                return EXIT_OK
            step = plan.step or "not begun"
            print(f"purge of {plan.session_id} (agent {plan.agent}, seq {plan.first_seq}.."
                  f"{plan.last_seq}; journal: {step})")
            for entry in plan.entries:
                size = f" {entry['bytes']} bytes" if entry["type"] == "file" else ""
                print(f"  {entry['type']:<4} {entry['path']}{size}")
            if data["refused"]:
                print(f"refused: {data['refused']['message']}")
            return EXIT_OK
        if args.confirm != sid:
            return _fail("--confirm must repeat the full session id exactly", EXIT_USAGE)
        plan = purge.purge(root, sid, agent_state=live)
    except purge.PurgeRefusedError as exc:
        if args.json:
            print(json.dumps({"ok": False, "reason": exc.reason, "message": str(exc)}))
        return _fail(f"purge refused: {exc}")
    if args.json:
        print(json.dumps({"ok": True, "session_id": sid, "journal": plan.step}))
    else:
        print(f"{PROG}: purged {sid}")
    return EXIT_OK


_VERBS = {"list": _list, "show": _show, "label": _label, "archive": _archive,
          "unarchive": _archive, "reindex": _reindex, "purge": _purge}


COMMANDS = (Command("sessions", _add, run),)
