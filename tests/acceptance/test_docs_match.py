"""The docs match the code, checked through the `supervisor` command: every
command and flag of the README's "Operating it" block is accepted and shown by
`--help`, every docs/ path a doc, the README or `--help` names exists, and
every exit code the README promises (and `up`'s 75 and 78) is observed from
a real command."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.acceptance.conftest import Corral, Result

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOC_PATH = re.compile(r"docs/[A-Za-z0-9_./-]+\.md")
GROUPS = {"sessions", "pipeline", "registry", "fleet", "wal"}  # commands with verbs


def operating_block() -> list[str]:
    """The usage column of each `supervisor ...` line of "Operating it"."""
    section = README.split("## Operating it", 1)[1].split("\n## ", 1)[0]
    return [re.split(r"\s{3,}", line.strip())[0] for line in section.splitlines()
            if line.startswith("    supervisor ")]


def documented(top_level: set[str]) -> dict[tuple[str, ...], set[str]]:
    """(command[, verb]) -> the flags the block gives it."""
    found: dict[tuple[str, ...], set[str]] = {}
    for usage in operating_block():
        current: tuple[str, ...] = ()
        for part in re.split(r" \| | ; ", usage.removeprefix("supervisor ")):
            words = part.replace("[", " ").replace("]", " ").split()
            if not words or words[0] == "...":
                continue
            head = words[0]
            if head in top_level:
                current = (head,)
                words = words[1:]
                if head in GROUPS and words and re.fullmatch(r"[a-z|]+", words[0]):
                    for verb in words[0].split("|"):
                        found.setdefault((head, verb), set())
                    current = (head, words[0].split("|")[0])
                    words = words[1:]
            elif current and current[0] in GROUPS and re.fullmatch(r"[a-z]+", head):
                current = (current[0], head)
                words = words[1:]
            elif head == "--version" and not current:
                found.setdefault((), set()).add(head)
                continue
            assert current or head.startswith("--"), f"cannot place {part!r} of {usage!r}"
            flags = {w for word in words for w in word.split("|") if w.startswith("--")}
            found.setdefault(current, set()).update(flags)
    return found


def top_level_commands(help_text: str) -> set[str]:
    listing = help_text.split("positional arguments:", 1)[1]
    return set(re.findall(r"^    ([a-z]+)\s", listing, flags=re.M))


def test_every_command_and_flag_of_the_readme_is_accepted_and_shown(corral: Corral) -> None:
    main_help = corral.run("--help").stdout
    commands = top_level_commands(main_help)
    assert {"up", "status", "du", "gc", "pipeline", "registry"} <= commands
    wanted = documented(commands)
    assert len(wanted) > 25  # the parse saw the whole block

    def helped(key: tuple[str, ...]) -> tuple[tuple[str, ...], Result]:
        return key, corral.run(*key, "--help", rc=None)

    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(pool.map(helped, [k for k in wanted if k]))
    problems = []
    for key, flags in sorted(wanted.items()):
        name = " ".join(key) or "(top level)"
        if key and key[0] not in main_help.split("positional arguments:")[0]:
            problems.append(f"{name}: not in the usage block of `supervisor --help`")
        text = helps[key].stdout if key else main_help
        if key and helps[key].returncode != 0:
            problems.append(f"{name} --help: exit {helps[key].returncode} {helps[key].stderr}")
            continue
        problems += [f"{name}: {flag} not in its --help" for flag in sorted(flags)
                     if flag not in text]
    assert problems == []


def test_every_docs_path_that_is_named_exists(corral: Corral) -> None:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").glob("*.md")}
    texts["README.md"] = README
    main_help = corral.run("--help").stdout
    texts["supervisor --help"] = main_help
    for command in sorted(top_level_commands(main_help) - {"wal", "fleet"}):
        texts[f"supervisor {command} --help"] = corral.run(command, "--help").stdout
    texts["supervisor wal verify --help"] = corral.run("wal", "verify", "--help").stdout
    missing = sorted({f"{where}: {path}" for where, text in texts.items()
                      for path in DOC_PATH.findall(text) if not (ROOT / path).is_file()})
    assert missing == []


def test_every_exit_code_the_readme_promises_is_observed(corral: Corral) -> None:
    promised = re.search(r"exit codes: (.*?)\(docs/supervisor\.md\)", README, flags=re.S)
    assert promised is not None
    codes = {int(c) for c in re.findall(r"(\d) [a-z]", promised.group(1))}
    assert codes == {0, 1, 2, 3, 4}
    seen: dict[int, str] = {}
    seen[corral.run("--version").returncode] = "--version"
    seen[corral.run("status", "--no-such-flag", rc=2).returncode] = "a bad flag"
    seen[corral.run("status", rc=3).returncode] = "status, nothing up"
    corral.up()
    seen[corral.run("stop", "no-such-child", rc=1).returncode] = "an unknown name"
    pid = corral.status()["supervisor_pid"]
    os.kill(pid, signal.SIGSTOP)  # a supervisor that does not answer
    try:
        stale = corral.run("status", "--json", rc=4)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stale.json()["stale"] is True
    seen[stale.returncode] = "status, no answer"
    assert set(seen) == codes, seen
    # `up`'s own (docs/supervisor.md): the state directory held, an invalid file
    held = corral.run("up", rc=75)
    assert "already supervised by pid" in held.stderr
    corral.write("bad.yaml", "agents: {count: many}\n")
    corral.run("up", "--config", "bad.yaml", "--state-dir", str(corral.home / "other"), rc=78)
