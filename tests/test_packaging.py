"""What `pip install corral` puts into an environment: only corral's own import
packages (broker, actors, supervisor), every one of their subpackages, and the
default configuration and demo tasks as package data of `supervisor`
(`supervisor.defaults`); never `config`, `ops` or `tests` (PyPI already has a
`config`). The wheel is built from this checkout and installed into a bare
directory, then used from outside the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT

OURS = {"broker", "actors", "supervisor"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a clean copy of the sources: setuptools would otherwise pack
    whatever a previous build left in the checkout's build/."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    for name in (*OURS, "config", "ops", "tests"):  # ops and tests must stay out
        shutil.copytree(REPO_ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, timeout=120, cwd=out)
    (built,) = out.glob("corral-*.whl")
    return built


@pytest.mark.timeout(150)
def test_wheel_holds_only_corrals_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == OURS
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert set(zipfile.ZipFile(wheel).read(top_level).decode().split()) == OURS
    packages = {str(p.parent.relative_to(REPO_ROOT)) for name in OURS
                for p in (REPO_ROOT / name).rglob("__init__.py")}
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages left out of the wheel (pyproject.toml): {missing}"
    tasks = {p.name for p in (REPO_ROOT / "config" / "tasks").glob("*.yaml")}
    assert "supervisor/defaults/default.yaml" in names
    assert {f"supervisor/defaults/tasks/{t}" for t in tasks} <= set(names)


@pytest.mark.timeout(150)
def test_installed_wheel_finds_its_defaults_outside_the_checkout(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), str(wheel)], check=True, capture_output=True,
                   timeout=120)
    probe = (
        "import importlib.util, sys\n"
        "from supervisor import config\n"
        "loaded = config.load(None)\n"
        "print(config.DEFAULT_CONFIG_PATH)\n"
        "print(sorted(p.name for p in (config.DEFAULTS_DIR / 'tasks').glob('*.yaml')))\n"
        "print([m for m in ('config', 'ops', 'tests') if importlib.util.find_spec(m)])\n"
    )
    done = subprocess.run([sys.executable, "-I", "-c",
                           f"import sys; sys.path.insert(0, {str(target)!r})\n{probe}"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    path, tasks, foreign = done.stdout.splitlines()
    assert path == str(target / "supervisor" / "defaults" / "default.yaml")
    assert tasks != "[]"
    assert foreign == "[]"
