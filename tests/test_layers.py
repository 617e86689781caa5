"""Layers import downward only (CONVENTIONS): `broker` imports nothing from
`actors` or `supervisor`; `actors` nothing from `supervisor`. Every import
statement counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"broker": {"actors", "supervisor"}, "actors": {"supervisor"}}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_layers_import_downward_only() -> None:
    wrong = []
    checked = 0
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            checked += 1
            for package in sorted(_imported_packages(path) & forbidden):
                wrong.append(f"{path.relative_to(ROOT)} imports {package}")
    assert checked > 20  # the layers were found
    assert wrong == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from supervisor.zygote import Forked\n    return Forked\n")
    assert "supervisor" in _imported_packages(module)


def _module_level_imports(path: Path) -> set[str]:
    """Modules imported at a module's top level (not inside a function)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports load nothing at run time
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_fleet_is_reached_only_through_its_hooks() -> None:
    """supervisor/fleet/ (docs/decisions.md, "Optional parts plug in through named
    hooks"): `broker` and `actors` never import it (the rule above: they import
    nothing of `supervisor`; their processes load it by name, `--hook`); the rest
    of `supervisor` imports it only inside the functions that run in fleet mode
    (supervisor/hooks.py, the fleet commands), never at a module's top level."""
    wrong = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        if (ROOT / "supervisor" / "fleet") in path.parents:
            continue
        for name in sorted(_module_level_imports(path)):
            if name == "supervisor.fleet" or name.startswith("supervisor.fleet."):
                wrong.append(f"{path.relative_to(ROOT)} imports {name} at its top level")
    assert wrong == []


def test_the_fleet_check_sees_a_top_level_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from supervisor.fleet import host\n\ndef f():\n"
                      "    from supervisor.fleet import ctl\n")
    assert _module_level_imports(module) == {"supervisor.fleet.host"}
