"""The gate: exclude, then confinement (absolute paths, `..`, symlinks out of
the workspace, and the write-gate on .corral/state and .corral/config), then
the permission rules (allow / ask / deny, first match, path globs and command
prefixes), with `--always` grants scoped to exactly one op and pattern."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

import pytest

from actors.agent import catalog
from actors.kernel import gate, workspace
from actors.kernel.ops import OpBase
from actors.kernel.settings import AgentSettings, Permissions, Rule
from broker.errors import PathRefusedError
from broker.statedir import StateDir

catalog.install()  # the ops these tests parse and run (a process does it at start)


def op(action: dict[str, object]) -> OpBase:
    parsed = catalog.parse_action(action)
    assert isinstance(parsed, OpBase), parsed
    return parsed


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text("a")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s")
    os.symlink(outside / "secret.txt", root / "link-out")
    os.symlink(outside, root / "dir-out")
    os.symlink(root / "docs" / "a.md", root / "link-in")
    return root


SETTINGS = AgentSettings(
    exclude=["search"],
    permissions=Permissions(default="allow", rules=[
        Rule(op="*", path="secrets/*", decision="deny"),
        Rule(op="write_file", path="release/*", decision="ask"),
        Rule(op="read_file", decision="allow"),
    ]),
)


def decide(o: OpBase, ws: Path, state_dir: StateDir,
           grants: frozenset[tuple[str, str]] = frozenset()) -> gate.GateDecision:
    return gate.decide(o, SETTINGS, grants, ws, state_dir)


def test_allow_ask_deny_and_exclude(ws: Path, state_dir: StateDir) -> None:
    assert decide(op({"op": "write_file", "path": "docs/b.md", "content": ""}), ws,
                  state_dir).verdict == "allow"
    asked = decide(op({"op": "write_file", "path": "release/n.md", "content": ""}), ws, state_dir)
    assert (asked.verdict, asked.rule, asked.pattern) == ("ask", "rules[1]", "release/n.md")
    assert decide(op({"op": "read_file", "path": "secrets/k"}), ws, state_dir).verdict == "deny"
    assert decide(op({"op": "search", "text": "x"}), ws, state_dir).verdict == "excluded"
    assert decide(op({"op": "ask", "question": "?"}), ws, state_dir).verdict == "ask"


def test_always_grant_is_scoped_to_one_op_and_pattern(ws: Path, state_dir: StateDir) -> None:
    grants = frozenset({("write_file", "release/n.md")})
    same = op({"op": "write_file", "path": "release/n.md", "content": ""})
    other_path = op({"op": "write_file", "path": "release/m.md", "content": ""})
    assert decide(same, ws, state_dir, grants).rule == "always"
    assert decide(other_path, ws, state_dir, grants).verdict == "ask"
    denied = op({"op": "write_file", "path": "secrets/x", "content": ""})
    assert decide(denied, ws, state_dir, frozenset({("write_file", "secrets/x")})).verdict \
        == "deny"


class RunCommand(OpBase):
    """A command op, as a later issue adds them (not registered here)."""

    op: Literal["run_command"] = "run_command"
    command: str
    command_field: ClassVar[str | None] = "command"


def test_command_prefix_rules(ws: Path, state_dir: StateDir) -> None:
    settings = AgentSettings(permissions=Permissions(rules=[
        Rule(op="run_command", command="rm ", decision="deny"),
        Rule(op="run_command", command="git push", decision="ask")]))
    assert gate.decide(RunCommand(command="rm -rf /"), settings, frozenset(), ws,
                       state_dir).verdict == "deny"
    assert gate.decide(RunCommand(command="git push origin"), settings, frozenset(), ws,
                       state_dir).verdict == "ask"
    assert gate.decide(RunCommand(command="ls"), settings, frozenset(), ws,
                       state_dir).verdict == "allow"


@pytest.mark.parametrize("path", [
    "/etc/passwd", "~/x", "../x", "docs/../../x", "..", "link-out",
    "dir-out/secret.txt", "dir-out", "", "link-in", "a\u202eb",
])
def test_every_traversal_attempt_is_refused(ws: Path, state_dir: StateDir, path: str) -> None:
    for action in ({"op": "read_file", "path": path},
                   {"op": "write_file", "path": path, "content": "x"}):
        if not path:
            with pytest.raises(PathRefusedError):
                workspace.resolve(ws, path, write=False)
            continue
        verdict = decide(op(action), ws, state_dir)
        assert (verdict.verdict, verdict.rule) == ("refused", "confinement"), (action, verdict)


def test_dotdot_inside_the_workspace_normalises(ws: Path, state_dir: StateDir) -> None:
    """`..` that stays inside the workspace is applied before the rules see the path."""
    verdict = decide(op({"op": "read_file", "path": "docs/../docs/a.md"}), ws, state_dir)
    assert (verdict.verdict, verdict.pattern) == ("allow", "docs/a.md")
    assert workspace.resolve(ws, "docs/../docs/a.md") == ws / "docs" / "a.md"


def test_write_gate_refuses_all_of_the_state_dir(state_dir: StateDir) -> None:
    """Every op is refused inside .corral/ (reads too: it holds other agents'
    streams and credentials), whatever tier, when the workspace contains it."""
    project = state_dir.root.parent  # a workspace that contains .corral/
    guard = workspace.guard_for(state_dir)
    for path in (".corral/state/wal/x.jsonl", ".corral/config/agents/a.json",
                 ".corral/state", ".corral/memory/n.md", ".corral/approvals.jsonl",
                 ".corral/run/x", "./.corral//agents/a/state/generations/gen-1.json"):
        for action in ({"op": "write_file", "path": path, "content": "x"},
                       {"op": "read_file", "path": path}):
            verdict = decide(op(action), project, state_dir)
            assert verdict.verdict == "refused" and "write-gate" in verdict.reason, verdict
        with pytest.raises(PathRefusedError, match="write-gate"):
            workspace.resolve(project, path, write=True, guard=guard)
