"""The gate every op passes, whatever model backend chose it: pure decisions.

Order: exclude (ops disabled by `agent.exclude`) -> confinement (the op's path
must resolve inside the workspace; writes must not reach `state/` or
`config/`) -> permission (rules, first match wins, else the default) ->
dispatch (the loop). An `ask` verdict becomes an approval request unless an
`--always` grant names exactly this op and this pattern; ops that need the
operator (`ask`) always wait for an answer.

The pattern of a request is the op's path (workspace-relative, as given) or
its command; an op with neither has the pattern "*".
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

from actors.agent import workspace
from actors.agent.ops import OpBase
from actors.agent.settings import AgentSettings, Rule
from broker.errors import PathRefusedError
from broker.statedir import StateDir

Verdict = Literal["allow", "ask", "deny", "excluded", "refused"]


@dataclass(frozen=True)
class GateDecision:
    verdict: Verdict
    rule: str  # "exclude", "confinement", "rules[2]", "default", "always", "operator"
    pattern: str
    reason: str = ""


def pattern_of(op: OpBase) -> str:
    return op.gate_path() or op.gate_command() or "*"


def _matches(rule: Rule, op: OpBase) -> bool:
    if rule.op not in ("*", op.op):
        return False
    if rule.path is not None:
        path = op.gate_path()
        if path is None or not fnmatchcase(path, rule.path):
            return False
    if rule.command is not None:
        command = op.gate_command()
        if command is None or not command.startswith(rule.command):
            return False
    return True


def permission(op: OpBase, settings: AgentSettings) -> tuple[str, str]:
    """(decision, rule name) from the permission rules alone."""
    for index, rule in enumerate(settings.permissions.rules):
        if _matches(rule, op):
            return rule.decision, f"rules[{index}]"
    return settings.permissions.default, "default"


def decide(
    op: OpBase,
    settings: AgentSettings,
    grants: frozenset[tuple[str, str]],
    ws: Path,
    state_dir: StateDir,
) -> GateDecision:
    """The gate's verdict for one validated op."""
    pattern = pattern_of(op)
    if op.op in settings.exclude:
        return GateDecision("excluded", "exclude", pattern, "op disabled by configuration")
    path = op.gate_path()
    if path is not None and path not in ("", "."):
        try:
            workspace.resolve(ws, path, write=op.mutates,
                              protected=(state_dir.state_dir, state_dir.config_dir))
        except PathRefusedError as exc:
            return GateDecision("refused", "confinement", pattern, exc.reason)
    decision, rule = permission(op, settings)
    if decision == "deny":
        return GateDecision("deny", rule, pattern, "denied by rule")
    if op.needs_operator:
        return GateDecision("ask", "operator", pattern)
    if decision == "ask":
        if (op.op, pattern) in grants:
            return GateDecision("allow", "always", pattern)
        return GateDecision("ask", rule, pattern)
    return GateDecision("allow", rule, pattern)
