"""Pipelines and the pipelines registry as a user drives them
(docs/pipelines.md): `pipeline check` of good and bad files, `pipeline run
--wait` of a file and of an installed name (success and failure, text and
JSON), and `registry show/apply/restore`. Schedules, hooks and MCP entries
are tests/acceptance/test_automation.py's. One runtime for the module."""

from __future__ import annotations

from typing import Any

import pytest

from tests.acceptance.conftest import Corral

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

# the shape of docs/pipelines.md's example: a step with an output, a bounded
# loop over an input, a condition on an earlier output, the run's outputs
NOTES = """\
name: release-notes
inputs: [version, files]
steps:
  - id: notes
    op: write_file
    args: {path: "notes/${inputs.version}.md", content: "v${inputs.version}"}
    output: notes
  - id: each
    for: {items: "${inputs.files}", as: f, max: 10}
    steps:
      - {id: w, op: write_file, args: {path: "${f}.txt", content: "${index}"}, output: w}
      - id: check
        if: {output: w, status: ok}
        then: [{id: r, op: read_file, args: {path: "${f}.txt"}}]
outputs: {bytes: "${outputs.notes.result.bytes}"}
"""
FAILING = """\
name: failing
steps:
  - {id: r, op: read_file, args: {path: does-not-exist.txt}, output: r}
  - {id: never, op: write_file, args: {path: never.txt, content: "x"}}
"""
REFUSED = {
    "bad.yaml": ("name: bad\nsteps:\n  - id: x\n    op: rm_everything\n    args: {}\n",
                 "bad.yaml:4: steps.0.op: unknown op 'rm_everything'"),
    "nested.yaml": ("name: nested\nsteps:\n  - id: n\n    op: pipeline_run\n"
                    "    args: {name: other}\n",
                    "nested.yaml:4: steps.0.op: op 'pipeline_run' is refused"),
    "alias.yaml": ("name: alias\nsteps:\n  - {id: a, op: write_file, args: &x {path: x, "
                   "content: y}}\n  - {id: b, op: write_file, args: *x}\n",
                   "aliases are not allowed (no recursion)"),
}


@pytest.fixture(scope="module")
def corral(module_corral: Corral) -> Corral:
    module_corral.write("notes.yaml", NOTES)
    module_corral.write("failing.yaml", FAILING)
    module_corral.up()
    return module_corral


def workspace(corral: Corral, runner: str) -> Any:
    return corral.state_dir / "agents" / runner / "workspace"


def test_check_accepts_a_good_file_and_names_the_line_of_a_bad_one(corral: Corral) -> None:
    ok = corral.run("pipeline", "check", "notes.yaml")
    assert "release-notes is valid" in ok.stdout + ok.stderr
    for name, (text, expected) in REFUSED.items():
        corral.write(name, text)
        refused = corral.run("pipeline", "check", name, rc=1)
        assert expected in refused.stderr, refused
        assert len(refused.stderr.splitlines()) == 1


def test_run_a_file_and_wait_text_and_json(corral: Corral) -> None:
    text = corral.run("pipeline", "run", "notes.yaml", "--input", "version=1.2",
                      "--input", 'files=["x", "y"]', "--wait").stdout
    assert "ok: outputs {\"bytes\": 4}" in text  # "v1.2"
    result = corral.json("pipeline", "run", "notes.yaml", "--input", "version=1.3",
                         "--input", 'files=["z"]', "--wait")
    assert result["status"] == "ok" and result["pipeline"] == "release-notes"
    assert result["outputs"] == {"bytes": 4}  # "v1.3"
    assert result["steps_settled"] == 3  # the ops: notes, then w and r for the one item
    done = workspace(corral, result["runner"])
    assert (done / "notes" / "1.3.md").read_text() == "v1.3"
    assert (done / "z.txt").read_text() == "0"
    records = corral.run("trace", result["runner"]).stdout
    assert "write_file OK" in records and "read_file OK" in records


def test_a_failed_run_says_why_text_and_json(corral: Corral) -> None:
    text = corral.run("pipeline", "run", "failing.yaml", "--wait", rc=1)
    assert "failed: step r ended error" in text.stdout + text.stderr
    result = corral.json("pipeline", "run", "failing.yaml", "--wait", rc=1)
    assert result["status"] == "failed" and result["error"] == "step r ended error"
    assert not (workspace(corral, result["runner"]) / "never.txt").exists()
    missing = corral.run("pipeline", "run", "notes.yaml", "--input", "version=1", rc=2)
    assert "files" in missing.stderr


def test_registry_install_run_remove_restore(corral: Corral) -> None:
    empty = corral.run("registry", "show").json()
    assert set(empty) == {"pipelines", "schedules", "hooks", "mcp"}
    assert empty["pipelines"]["entries"] == []
    installed = corral.run("registry", "apply", "pipeline_install", "--args",
                           f'{{"path": "{corral.home / "notes.yaml"}", "name": "rel"}}').json()
    assert installed["changed"] is True and installed["entries"] == ["rel"]
    seq = installed["generation_seq"]
    shown = corral.run("registry", "show", "pipelines").json()["pipelines"]
    assert shown["generation_seq"] == seq
    assert [(e["name"], e["text"]) for e in shown["entries"]] == [("rel", NOTES)]

    result = corral.json("pipeline", "run", "rel", "--input", "version=2",
                         "--input", "files=[]", "--wait")
    assert result["status"] == "ok" and result["outputs"] == {"bytes": 2}

    removed = corral.run("registry", "apply", "pipeline_remove", "--args",
                         '{"name": "rel"}').json()
    assert removed["entries"] == [] and removed["generation_seq"] > seq
    unknown = corral.run("pipeline", "run", "rel", "--input", "version=3", "--wait", rc=1)
    assert "rel" in unknown.stderr
    as_of = corral.run("registry", "show", "pipelines", "--seq", str(seq)).json()
    assert [e["name"] for e in as_of["pipelines"]["entries"]] == ["rel"]

    corral.run("registry", "restore", str(seq))
    back = corral.run("registry", "show", "pipelines").json()["pipelines"]
    assert [e["name"] for e in back["entries"]] == ["rel"]
    assert back["generation_seq"] > removed["generation_seq"]
    refused = corral.run("registry", "apply", "pipeline_remove", "--args",
                         '{"name": "nosuch"}', rc=1)
    assert "nosuch" in refused.stderr and len(refused.stderr.splitlines()) == 1
