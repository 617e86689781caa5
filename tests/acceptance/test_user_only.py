"""The acceptance suite stays on the user's side (issue 32): no file under
tests/acceptance imports corral's packages (broker, actors, supervisor), and
none writes under `.corral/` (the state directory is the runtime's: a user
only reads the files the docs name; making the directory itself, say to
mount a volume there, is an operator's step). A static check of the source (ast), with
the checker itself tested on code it must refuse."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

HERE = Path(__file__).resolve().parent
CORRAL_PACKAGES = {"broker", "actors", "supervisor"}
# calls that change the file system: methods of Path, os and shutil, and open()
WRITING_METHODS = {
    "write_text", "write_bytes", "mkdir", "touch", "unlink", "rename", "replace", "rmdir",
    "symlink_to", "hardlink_to", "chmod", "truncate", "makedirs", "remove", "removedirs",
    "rmtree", "copy", "copy2", "copyfile", "copytree", "move", "utime",
}


def _names_state_dir(node: ast.AST) -> bool:
    """The expression mentions the state directory: `.state_dir` or a '.corral' text."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "state_dir":
            return True
        if isinstance(sub, ast.Name) and sub.id == "state_dir":
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) \
                and ".corral" in sub.value:
            return True
    return False


def _is_the_state_dir(node: ast.AST) -> bool:
    """`x.state_dir` itself (a user may make the directory, e.g. to mount a volume
    there, as an operator does before the first `up`), not a path under it."""
    return (isinstance(node, ast.Attribute) and node.attr == "state_dir") or (
        isinstance(node, ast.Name) and node.id == "state_dir")


def _opens_for_writing(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) \
        and any(c in mode.value for c in "wax+")


def violations(source: str, filename: str = "<test>") -> list[str]:
    """What in `source` imports corral or writes under `.corral/`, one line each."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in CORRAL_PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] in CORRAL_PACKAGES:
                found.append(f"{where}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else (
                func.id if isinstance(func, ast.Name) else "")
            if name in {"import_module", "__import__"} and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).split(".")[0] in CORRAL_PACKAGES:
                found.append(f"{where}: imports {node.args[0].value} dynamically")
            elif name == "mkdir" and isinstance(func, ast.Attribute) \
                    and _is_the_state_dir(func.value):
                continue
            elif name in WRITING_METHODS and _names_state_dir(node):
                found.append(f"{where}: {name}() under the state directory")
            elif name == "open" and _opens_for_writing(node) and _names_state_dir(node):
                found.append(f"{where}: open() for writing under the state directory")
            elif name == "write" and isinstance(func, ast.Attribute) and node.args \
                    and _names_state_dir(node.args[0]):
                found.append(f"{where}: writes a file under the state directory")
    return found


def test_no_acceptance_file_imports_corral_or_writes_its_state() -> None:
    files = sorted(HERE.rglob("*.py"))
    assert HERE / "conftest.py" in files and len(files) > 3
    found = [v for path in files
             for v in violations(path.read_text(), str(path.relative_to(HERE)))]
    assert found == []


@pytest.mark.parametrize("source", [
    "import supervisor.config",
    "import actors",
    "from broker.protocol import encode",
    "from supervisor import cli as c",
    "importlib.import_module('actors.writer')",
    "(corral.state_dir / 'config' / 'x.yaml').write_text('entries: []')",
    "(home / '.corral' / 'run').mkdir()",
    "(corral.state_dir / 'run').mkdir(parents=True)",
    "open(corral.state_dir / 'run' / 'x', 'w')",
    "open(path_of('.corral/config/hooks.yaml'), mode='a')",
    "corral.write('.corral/config/schedules.yaml', 'x: 1')",
    "shutil.rmtree(corral.state_dir / 'state')",
])
def test_the_check_refuses_what_it_must(source: str) -> None:
    assert violations(source) != []


@pytest.mark.parametrize("source", [
    "from tests.acceptance.conftest import Corral",
    "(corral.state_dir / 'run' / 'metrics.port').read_text()",
    "corral.write('task.yaml', 'name: t')",
    "open(corral.state_dir / 'run' / 'status.json')",
    "text = 'from supervisor.config import DEFAULT_CONFIG_PATH'",
    "corral.state_dir.mkdir()",
])
def test_the_check_lets_a_user_read(source: str) -> None:
    assert violations(source) == []
