"""Every `supervisor` command finds its state directory the same way:
`--state-dir`, else `$CORRAL_STATE_DIR`, else `./.corral` (StateDir.resolve)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.statedir import STATE_DIR_ENV, StateDir

SUPERVISOR_DIR = Path(__file__).resolve().parent.parent / "supervisor"


def test_flag_wins_over_the_environment(tmp_path: Path) -> None:
    env = {STATE_DIR_ENV: str(tmp_path / "env")}
    assert StateDir.resolve(str(tmp_path / "flag"), env).root == tmp_path / "flag"


def test_environment_when_no_flag(tmp_path: Path) -> None:
    env = {STATE_DIR_ENV: str(tmp_path / "env")}
    assert StateDir.resolve(None, env).root == tmp_path / "env"


@pytest.mark.parametrize("env", [{}, {STATE_DIR_ENV: ""}])
def test_dot_corral_in_the_working_directory_otherwise(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert StateDir.resolve(None, env).root == tmp_path / ".corral"


def test_reads_the_process_environment_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "srv"))
    assert StateDir.resolve(None).root == tmp_path / "srv"


def test_every_command_with_a_state_dir_flag_resolves_it_there() -> None:
    """A module that takes `--state-dir` never builds the path another way."""
    takers = [p for p in SUPERVISOR_DIR.rglob("*.py") if '"--state-dir"' in p.read_text()]
    assert takers  # the scan sees the CLI modules
    astray = [p.name for p in takers if "StateDir.at(" in p.read_text()]
    assert astray == []
