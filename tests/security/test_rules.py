"""Rules that mean what they say, tried through a scripted agent: path rules
match the normalised workspace-relative path (`./secrets/key` and every
other spelling of it are denied by `secrets/*`), a path escaping the
workspace is refused before any rule, `search` and `list_dir` leave out what
a rule denies, and command rules hold on `bash`, `bash_start` and
`terminal_start` alike against the usual spellings around them (`/bin/rm`,
`env rm`, `;rm`, `\\rm`, `$(echo rm)`, ...). The agent has no procs here: a
command the gate lets through fails with "procs is not reachable", one it
denies never gets that far."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.agent import catalog
from actors.kernel import commands, gate
from actors.kernel.ops import OpBase
from actors.kernel.settings import AgentSettings, Permissions, Rule
from broker.statedir import StateDir
from tests.security.kit import decisions, results, run_agent

catalog.install()  # the ops these tests parse and run (a process does it at start)

FINISH = {"op": "finish", "summary": "done"}
SECRET = "TOP-SECRET-VALUE"


@pytest.fixture
def ws(state_dir: StateDir) -> Path:
    root = state_dir.root.parent / "ws"
    (root / "secrets").mkdir(parents=True)
    (root / "secrets" / "key").write_text(f"{SECRET}\n")
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print('hi')\n")
    return root


def test_every_spelling_of_a_denied_path_is_denied(state_dir: StateDir, ws: Path) -> None:
    spellings = ["secrets/key", "./secrets/key", "src/../secrets/key", "secrets//key",
                 "./secrets/./key", f"{ws}/secrets/key", f"{ws}/src/../secrets/key"]
    steps = [{"op": "read_file", "path": p} for p in spellings]
    steps += [{"op": "edit_file", "path": "./secrets/key", "old": "TOP", "new": "x"},
              {"op": "write_file", "path": "secrets//new", "content": "x"},
              {"op": "search", "text": "TOP", "path": "./secrets"},
              {"op": "read_file", "path": "src/app.py"}, FINISH]
    writer, _ = run_agent(state_dir, ws, steps)
    # the directory itself is not matched by `secrets/*`: searching it is
    # allowed, and finds nothing, as what is under it is denied
    assert decisions(writer) == ["deny"] * (len(spellings) + 2) + ["allow"] * 3
    assert results(writer)[-3]["result"]["matches"] == []
    assert SECRET not in json.dumps(writer.events("agent/a1"))
    assert not (ws / "secrets" / "new").exists()


def test_a_path_escaping_the_workspace_is_refused_before_the_rules(
    state_dir: StateDir, ws: Path
) -> None:
    """`../x` is not "allowed by the default" nor "denied by a rule": refused."""
    writer, _ = run_agent(state_dir, ws, [
        {"op": "read_file", "path": "../ws/secrets/key"},
        {"op": "read_file", "path": "src/../../x"},
        {"op": "read_file", "path": "/etc/hostname"},
        FINISH,
    ], rules=[Rule(op="read_file", decision="allow")])
    assert decisions(writer) == ["refused", "refused", "refused", "allow"]


def test_search_and_list_dir_leave_out_denied_paths(state_dir: StateDir, ws: Path) -> None:
    (ws / "src" / "token.txt").write_text(f"{SECRET} in the open\n")
    (ws / "private").mkdir()
    (ws / "private" / "notes.txt").write_text(f"{SECRET} asked for\n")
    writer, _ = run_agent(state_dir, ws, [
        {"op": "search", "text": SECRET},
        {"op": "search", "text": SECRET, "path": "."},
        {"op": "list_dir", "path": "secrets"},
        {"op": "list_dir", "path": "./secrets/"},
        {"op": "list_dir"},
        FINISH,
    ], rules=[Rule(op="*", path="secrets/*", decision="deny"),
              Rule(op="*", path="private/*", decision="ask")])
    got = results(writer)
    for search in got[:2]:
        assert [m["path"] for m in search["result"]["matches"]] == ["src/token.txt"]
    assert got[2]["result"]["entries"] == [] and got[3]["result"]["entries"] == []
    assert {e["name"] for e in got[4]["result"]["entries"]} == {"secrets", "src", "private"}


BYPASSES = ["rm -rf x", "/bin/rm -rf x", "/usr/bin/rm x", "env rm x", "env -i FOO=1 rm x",
            "true;rm x", "true ; rm x", "true && rm x", "false || rm x", "ls | rm x",
            "\\rm x", "'rm' x", "r''m x", "$(echo rm) x", "`echo rm` x", "FOO=1 rm x",
            "command rm x", "nohup rm x", "sudo -u root rm x", "timeout 5 rm x",
            "bash -c 'rm x'", "sh -c \"true; rm x\"", "echo ok\nrm x", "X=rm; $X x",
            "if true; then rm x; fi", "(rm x)", "find . | xargs rm", "nice -n 5 rm x"]
COMMAND_OPS = ["bash", "bash_start", "terminal_start"]


@pytest.mark.parametrize("rule_op", ["bash", "terminal_start"])
def test_command_rules_hold_on_every_command_op_and_spelling(
    state_dir: StateDir, ws: Path, rule_op: str
) -> None:
    """A deny rule written for one command op denies every spelling of the
    command on all three (the rule is a convenience: the sandbox is the
    boundary, docs/agents.md)."""
    steps = [{"op": op, "command": c} for op in COMMAND_OPS for c in BYPASSES]
    steps += [{"op": op, "command": "ls -l"} for op in COMMAND_OPS]
    writer, _ = run_agent(state_dir, ws, [*steps, FINISH], rules=[
        Rule(op=rule_op, command="rm", decision="deny")])
    got = decisions(writer)
    denied = [f"{s['op']}: {s['command']!r}" for s, d in zip(steps, got, strict=False)
              if d != "deny"]
    assert denied[:3] == [f"{op}: 'ls -l'" for op in COMMAND_OPS], denied
    assert len(denied) == 3


def test_an_allow_rule_covers_only_lines_made_wholly_of_what_it_allows(
    state_dir: StateDir, ws: Path
) -> None:
    writer, _ = run_agent(state_dir, ws, [
        {"op": "bash", "command": "git status"},
        {"op": "bash_start", "command": "git status && git diff"},
        {"op": "bash", "command": "git status; rm -rf x"},
        {"op": "bash", "command": "git status $(rm -rf x)"},
        {"op": "terminal_start", "command": "git statusx"},
        FINISH,
    ], default="deny", rules=[Rule(op="bash", command="git status", decision="allow"),
                              Rule(op="bash", command="git diff", decision="allow"),
                              Rule(op="finish", decision="allow")])
    assert decisions(writer) == ["allow", "deny", "deny", "deny", "deny", "allow"]


def test_simple_commands_reads_a_line_as_a_shell_would() -> None:
    assert commands.simple_commands("env -i A=1 /bin/rm -rf x; echo 'a;b'") == [
        ["rm", "-rf", "x"], ["echo", "a;b"]]
    assert commands.simple_commands("bash -c 'cd x && \\rm y'") == [["cd", "x"], ["rm", "y"]]
    for opaque in ("$(echo rm) x", "echo `id`", "eval rm", "$CMD x", "rm${IFS}x", "'unclosed",
                   "cat <(rm x)", ". ./script"):
        assert commands.simple_commands(opaque) is None, opaque


def test_an_always_grant_on_a_command_covers_that_command_only(ws: Path,
                                                              state_dir: StateDir) -> None:
    """The pattern of a command op is its command, not its working directory
    (before, `bash` asked with pattern "." and one `--always` covered every
    command run there)."""
    settings = AgentSettings(permissions=Permissions(rules=[
        Rule(op="bash", decision="ask")]))
    make = catalog.parse_action({"op": "bash", "command": "make test"})
    other = catalog.parse_action({"op": "bash", "command": "rm -rf /"})
    assert isinstance(make, OpBase) and isinstance(other, OpBase)
    asked = gate.decide(make, settings, frozenset(), ws, state_dir)
    assert (asked.verdict, asked.pattern) == ("ask", "make test")
    grants = frozenset({("bash", asked.pattern)})
    assert gate.decide(make, settings, grants, ws, state_dir).verdict == "allow"
    assert gate.decide(other, settings, grants, ws, state_dir).verdict == "ask"
    assert gate.decide(other, settings, frozenset({("bash", ".")}), ws,
                       state_dir).verdict == "ask"
