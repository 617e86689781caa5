"""`supervisor completion bash|zsh` prints a script the shell parses
(docs/operations.md installs it), naming the subcommands; `--version` says
corral's version. No runtime needed."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

SUBCOMMANDS = ("up", "status", "stop", "spawn", "trace", "sessions", "rewind", "fork",
               "pipeline", "registry", "du", "gc")


def check_syntax(shell: str, script: str) -> None:
    checked = subprocess.run([shell, "-n"], input=script, capture_output=True, text=True,
                             timeout=30, check=False)
    assert checked.returncode == 0, checked.stderr


def test_bash_completion_parses_and_names_the_subcommands(corral: Corral) -> None:
    script = corral.run("completion", "bash").stdout
    check_syntax("bash", script)
    assert "complete " in script
    assert all(re.search(rf"\b{name}\b", script) for name in SUBCOMMANDS)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_parses(corral: Corral) -> None:
    script = corral.run("completion", "zsh").stdout
    check_syntax("zsh", script)
    assert script.startswith("#compdef")


def test_completion_of_another_shell_is_a_usage_error(corral: Corral) -> None:
    refused = corral.run("completion", "fish", rc=2)
    assert "fish" in refused.stderr


def test_version(corral: Corral) -> None:
    out = corral.run("--version").stdout
    assert re.match(r"corral \d+\.\d+\.\d+", out)
