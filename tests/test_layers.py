"""Layers import downward only (CONVENTIONS, docs/architecture.md): `broker`
imports nothing from `actors` or `supervisor`; `actors` nothing from
`supervisor`; no two modules of the three import each other, however
indirectly; and inside actors/ each package imports only packages of its
level or below (`ACTORS_ORDER`). Every import statement counts: those inside
functions and under `if TYPE_CHECKING:` too (read from the AST, relative
imports resolved)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"broker": {"actors", "supervisor"}, "actors": {"supervisor"}}
LAYERS = ("actors", "broker", "supervisor")

# The packages (and top-level modules) of actors/, bottom first. A module
# may import modules of its own level or below, never above; its unit is the
# longest name here that prefixes its own. Every `__main__` is a process's
# start: the top.
ACTORS_ORDER: tuple[frozenset[str], ...] = tuple(frozenset(level) for level in (
    {"actors.writer", "actors.envscrub", "actors.sibling", "actors.zygotewire",
     "actors.zygotelink"},
    {"actors.changesets"},
    {"actors.kernel"},  # state and its fold, op registry, settings, workspace, gate
    {"actors.registries"},  # the registry store (mcp servers, schedules, pipelines)
    {"actors.procs", "actors.trees", "actors.sessions"},
    # the registry ops check a pipeline before they install it
    {"actors.subagents", "actors.pipelines", "actors.registries.ops"},
    {"actors.agent"},  # the loop, the op catalogue, the model backends
    {"actors.zygote", "__main__"},  # the zygote preloads the agent and runs it
))

def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path, layers: tuple[str, ...] = LAYERS) -> dict[str, Path]:
    return {_module_name(path, root): path
            for layer in layers for path in sorted((root / layer).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours `name` is or lives in (`a.b.C` -> `a.b`), or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _candidates(node: ast.Import | ast.ImportFrom, module: str, is_package: bool
                ) -> Iterator[list[str]]:
    """For each name an import statement binds, the dotted names it may be,
    likeliest first (`from a import b`: the module `a.b`, else a name in `a`)."""
    if isinstance(node, ast.Import):
        yield from ([alias.name] for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package, up level - 1
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[:len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    for alias in node.names:
        yield [f"{base}.{alias.name}", base]


@functools.cache
def _import_graph(root: Path = ROOT, layers: tuple[str, ...] = LAYERS
                  ) -> dict[str, set[str]]:
    """Each module's imports of our own modules, every import statement counted."""
    modules = _modules(root, layers)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for names in _candidates(node, module, path.name == "__init__.py"):
                    target = next((found for name in names
                                   if (found := _resolve(name, modules)) is not None), None)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(start: str) -> None:  # iterative: the graph is deep
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _level(module: str) -> int | None:
    if module.endswith(".__main__"):
        return next(i for i, level in enumerate(ACTORS_ORDER) if "__main__" in level)
    parts = module.split(".")
    while parts:
        unit = ".".join(parts)
        for i, level in enumerate(ACTORS_ORDER):
            if unit in level:
                return i
        parts.pop()
    return None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        if not module.startswith("actors."):
            continue  # (actors/__init__.py imports nothing)
        mine = _level(module)
        for target in sorted(targets):
            theirs = _level(target) if target.startswith("actors.") else None
            if mine is None or (theirs is not None and theirs > mine):
                wrong.append(f"{module} (level {mine}) imports {target} (level {theirs})")
    return wrong


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
    (supervisor/runtime/hooks.py, the fleet commands), never at a module's top level."""
    wrong = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        if (ROOT / "supervisor" / "fleet") in path.parents:
            continue
        for name in sorted(_module_level_imports(path)):
            if name == "supervisor.fleet" or name.startswith("supervisor.fleet."):
                wrong.append(f"{path.relative_to(ROOT)} imports {name} at its top level")
    assert wrong == []


def test_the_runtime_never_imports_the_cli() -> None:
    """supervisor/runtime/ (the running supervisor) reaches nothing of
    supervisor/cli/ (the operator's commands, docs/supervisor.md "Code layout"),
    however indirectly; the CLI may use the runtime's parts (`up`, the status file)."""
    graph = _import_graph()
    assert "supervisor.runtime.up" in graph["supervisor.cli.up"]  # the other way is fine
    reached = {m for m in graph if m.startswith("supervisor.runtime.")}
    todo = list(reached)
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert "supervisor.automation" in reached  # the walk goes past the runtime
    assert sorted(m for m in reached if m.split(".")[:2] == ["supervisor", "cli"]) == []


def test_the_fleet_check_sees_a_top_level_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from supervisor.fleet import host\n\ndef f():\n"
                      "    from supervisor.fleet import ctl\n")
    assert _module_level_imports(module) == {"supervisor.fleet.host"}
def test_no_import_cycles_between_modules() -> None:
    """No module of actors/, broker/ or supervisor/ reaches itself through
    imports, function-level and `TYPE_CHECKING` ones included."""
    graph = _import_graph()
    assert len(graph) > 200  # the modules were found
    assert "actors.kernel.state" in graph["actors.kernel.fold"]  # imports are read
    assert [sorted(c) for c in _cycles(graph)] == []


def test_actors_packages_import_downward_only() -> None:
    """Inside actors/, a package imports only its level or below (`ACTORS_ORDER`):
    the kernel nothing above it, the loop and catalogue everything they call."""
    graph = _import_graph()
    assert all(_level(m) is not None for m in graph if m.startswith("actors."))
    assert _upward(graph) == []


def test_the_checks_see_a_function_level_cycle_and_an_upward_import(tmp_path: Path) -> None:
    actors = tmp_path / "actors"
    (actors / "kernel").mkdir(parents=True)
    (actors / "agent").mkdir()
    for package in (actors, actors / "kernel", actors / "agent"):
        (package / "__init__.py").write_text("")
    (actors / "kernel" / "state.py").write_text(
        "def f():\n    from ..agent import loop\n    return loop\n")
    (actors / "agent" / "loop.py").write_text("from actors.kernel.state import f\n")
    graph = _import_graph(tmp_path, ("actors",))
    assert graph["actors.kernel.state"] == {"actors.agent.loop"}  # relative, in a function
    assert _cycles(graph) == [frozenset({"actors.kernel.state", "actors.agent.loop"})]
    assert _upward(graph) == ["actors.kernel.state (level 2) imports actors.agent.loop (level 6)"]


def test_importing_the_ops_registers_nothing() -> None:
    """Ops join the registry where a process installs them (actors/agent/catalog.py),
    never as a side effect of importing their modules."""
    code = ("from actors.agent import catalog\n"
            "from actors.kernel import ops\n"
            "assert ops.op_names() == [], ops.op_names()\n"
            "catalog.install()\n"
            "names = ops.op_names()\n"
            "assert {'read_file', 'bash', 'pipeline_run', 'pipeline_install',\n"
            "        'spawn_subagent', 'mcp_call'} <= set(names), names\n"
            "catalog.install()\n"
            "assert ops.op_names() == names\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
