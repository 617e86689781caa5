"""The gate every op passes, whatever backend chose it: pure decisions.

Order: exclude -> confinement -> permission rules -> dispatch.
See docs/agents.md ("The gate") and docs/security.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

from actors.kernel import commands, workspace
from actors.kernel.ops import OpBase
from actors.kernel.settings import AgentSettings, Rule
from broker.errors import PathRefusedError
from broker.statedir import StateDir

Verdict = Literal["allow", "ask", "deny", "excluded", "refused"]


@dataclass(frozen=True)
class GateDecision:
    verdict: Verdict
    rule: str  # "exclude", "confinement", "rules[2]", "default", "always", "operator"
    pattern: str
    reason: str = ""


COMMAND_OPS = frozenset({"bash", "bash_start", "terminal_start"})


def gate_path(op: OpBase, ws: Path) -> str | None:
    """The op's path normalised (workspace.normalise); None when the op has
    none. Raises PathRefusedError for a path that escapes or is malformed."""
    raw = op.gate_path()
    return None if raw is None else workspace.normalise(ws, raw or ".")


def pattern_of(op: OpBase, ws: Path | None = None) -> str:
    """The request pattern: the command of an op that runs one (its working
    directory is not what is approved), else the normalised path (the raw one
    without `ws`), else "*"."""
    command = op.gate_command()
    if command is not None:
        return command
    if op.gate_op() != op.op:  # an MCP call: its server and tool
        return op.gate_op()
    path = op.gate_path()
    if path is not None and ws is not None:
        with contextlib.suppress(PathRefusedError):
            path = workspace.normalise(ws, path or ".")
    return path or "*"


def _op_matches(rule: Rule, op: str) -> bool:
    if rule.op in ("*", op):
        return True
    if op.startswith("mcp:"):  # `mcp:<server>/<tool>` (globs allowed) or `mcp_call`: all
        return rule.op == "mcp_call" or (rule.op.startswith("mcp:")
                                         and fnmatchcase(op, rule.op))
    # a command rule on one command op holds for all of them
    return rule.command is not None and rule.op in COMMAND_OPS and op in COMMAND_OPS


def _command_matches(rule: Rule, command: str) -> bool:
    """Deny and ask rules match when any simple command starts with the rule's
    words (or the line is opaque); allow rules only when every one does."""
    prefix = commands.rule_words(rule.command or "")
    found = commands.simple_commands(command)
    if found is None:
        return rule.decision != "allow"
    if rule.decision == "allow":
        return bool(found) and all(commands.starts_with(words, prefix) for words in found)
    return any(commands.starts_with(words, prefix) for words in found)


def _matches(rule: Rule, op_name: str, path: str | None, command: str | None) -> bool:
    if not _op_matches(rule, op_name):
        return False
    if rule.path is not None and (path is None or not fnmatchcase(path, rule.path)):
        return False
    return rule.command is None or (command is not None and _command_matches(rule, command))


def permission_at(op_name: str, path: str | None, command: str | None,
                  settings: AgentSettings) -> tuple[str, str]:
    """(decision, rule name) for an op name with a normalised path / a command."""
    for index, rule in enumerate(settings.permissions.rules):
        if _matches(rule, op_name, path, command):
            return rule.decision, f"rules[{index}]"
    return settings.permissions.default, "default"


def permission(op: OpBase, settings: AgentSettings, ws: Path | None = None) -> tuple[str, str]:
    """(decision, rule name) from the permission rules alone (the path
    normalised against `ws` when given)."""
    path = op.gate_path()
    if path is not None and ws is not None:
        path = workspace.normalise(ws, path or ".")
    return permission_at(op.gate_op(), path, op.gate_command(), settings)


def visible(op_name: str, rel: str, settings: AgentSettings, rule: str | None) -> bool:
    """Whether an op that was let through by `rule` may show `rel` (a search
    result, a directory entry): not when a rule denies the op there, nor when
    one asks there that is not the rule the op itself passed by."""
    decision, at = permission_at(op_name, rel, None, settings)
    return decision == "allow" or (decision == "ask" and at == rule)


def decide(
    op: OpBase,
    settings: AgentSettings,
    grants: frozenset[tuple[str, str]],
    ws: Path,
    state_dir: StateDir,
) -> GateDecision:
    """The gate's verdict for one validated op."""
    pattern = pattern_of(op, ws)
    if op.op in settings.exclude or op.gate_op() in settings.exclude:
        return GateDecision("excluded", "exclude", pattern, "op disabled by configuration")
    try:
        path = gate_path(op, ws)
        if path is not None:
            workspace.check(workspace.Place(ws, path, workspace.guard_for(state_dir)),
                            want_dir=False if op.mutates else None)
    except PathRefusedError as exc:
        return GateDecision("refused", "confinement", pattern, exc.reason)
    decision, rule = permission_at(op.gate_op(), path, op.gate_command(), settings)
    if decision == "deny":
        return GateDecision("deny", rule, pattern, "denied by rule")
    if op.needs_operator:
        return GateDecision("ask", "operator", pattern)
    if decision == "ask":
        if (op.op, pattern) in grants:
            return GateDecision("allow", "always", pattern)
        return GateDecision("ask", rule, pattern)
    return GateDecision("allow", rule, pattern)
