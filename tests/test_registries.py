"""Registries as config generations, in-process over the in-memory writer: each
registry op (through the agent loop and its gate) writes one full-state
generation keyed by the seq of its fact and rewrites the materialised yaml; a
restore to an earlier seq gives the earlier content back as new generations
(none deleted); an op run again for the same call changes nothing twice; a
change cut between its append and its rename is named from the stream; a
rule can deny a registry op like any op."""

from __future__ import annotations

from pathlib import Path

import yaml

from actors.agent import catalog
from actors.agent.loop import AgentLoop, Step
from actors.kernel.ops import OpContext
from actors.kernel.settings import Rule
from actors.registries import entries, ops, schemas, store
from broker.statedir import StateDir
from tests.agentkit import FakeWriter, spec, write_task

catalog.install()  # the ops these tests parse and run (a process does it at start)

PIPE = {"name": "hello", "steps": [
    {"id": "w", "op": "write_file", "args": {"path": "hello.txt", "content": "hi"}}]}
STEPS = [
    {"op": "write_file", "path": "hello.yaml", "content": yaml.safe_dump(PIPE)},
    {"op": "pipeline_install", "path": "hello.yaml"},
    {"op": "schedule_add", "entry": {"name": "nightly", "cron": "0 3 * * *",
                                     "action": "pipeline", "pipeline": "hello"}},
    {"op": "hook_add", "entry": {"name": "notify", "on": ["agent_finished"],
                                 "url": "http://127.0.0.1:9/x"}},
    {"op": "mcp_install", "entry": {"name": "files", "command": ["mcp-files", "--ro"]}},
    {"op": "schedule_enable", "name": "nightly", "enabled": False},
    {"op": "pipeline_remove", "name": "hello"},
    {"op": "finish", "summary": "done"},
]


def run_agent(state_dir: StateDir, writer: FakeWriter, task: Path,
              rules: list[Rule] | None = None) -> AgentLoop:
    loop = AgentLoop("a1", state_dir, spec(task, rules=rules),
                     writer.as_origin("a1"))  # type: ignore[arg-type]
    loop.rebuild()
    for _ in range(500):
        if loop.step() is not Step.PROGRESS:
            return loop
    raise AssertionError("the agent did not settle")


def test_ops_write_generations_and_a_restore_gives_the_earlier_content(
        state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    run_agent(state_dir, writer, write_task(tmp_path / "t.yaml", STEPS))
    facts = [(r.seq, r.payload()) for r in writer.records if r.stream == store.STREAM]
    assert [(p["registry"], p["op"]) for _, p in facts] == [
        ("pipelines", "pipeline_install"), ("schedules", "schedule_add"),
        ("hooks", "hook_add"), ("mcp", "mcp_install"), ("schedules", "schedule_enable"),
        ("pipelines", "pipeline_remove")]
    # every generation is on disk under its fact's seq, full state, named by its digest
    pipelines = store.history(state_dir, "pipelines")
    assert [g.seq for g in pipelines] == [facts[0][0], facts[5][0]]
    assert [g.names() for g in pipelines] == [["hello"], []]
    assert all(g.sha256 == p["sha256"] for g, (_, p) in zip(pipelines, [facts[0], facts[5]],
                                                           strict=True))
    installed = store.at(state_dir, "pipelines", facts[0][0]).get("hello")
    assert installed is not None and installed["text"] == yaml.safe_dump(PIPE)
    assert store.newest(state_dir, "schedules").get("nightly")["enabled"] is False  # type: ignore[index]
    materialised = yaml.safe_load(store.yaml_path(state_dir, "schedules").read_text())
    assert materialised["generation_seq"] == facts[4][0]
    assert materialised["entries"][0]["enabled"] is False
    assert not list(store.directory(state_dir, "pipelines").glob("pending-*"))

    # a rewind of another session's agent restores nothing (a1 made every change)
    assert store.restore_registries(state_dir, writer.as_origin("operator"), facts[0][0],
                                    changed_by="someone-else") == []
    # restore to just after the install: pipelines and schedules go back, hooks and
    # mcp already hold their content then; nothing is deleted
    restore_at = facts[3][0]
    written = store.restore_registries(state_dir, writer.as_origin("operator"), restore_at)
    assert sorted(g.registry for g in written) == ["pipelines", "schedules"]
    assert store.newest(state_dir, "pipelines").names() == ["hello"]
    assert store.newest(state_dir, "schedules").get("nightly")["enabled"] is True  # type: ignore[index]
    assert len(store.history(state_dir, "pipelines")) == 3
    assert yaml.safe_load(store.yaml_path(state_dir, "pipelines").read_text())[
        "entries"][0]["name"] == "hello"
    # and a restore to before anything empties every registry, again as new generations
    store.restore_registries(state_dir, writer.as_origin("operator"), facts[0][0] - 1)
    assert all(store.newest(state_dir, r).entries == [] for r in schemas.REGISTRIES)


def test_an_op_run_again_for_the_same_call_changes_nothing_twice(state_dir: StateDir) -> None:
    writer = FakeWriter().as_origin("a1")
    ctx = OpContext(agent="a1", workspace=state_dir.root.parent, memory_dir=state_dir.root,
                    state_dir=state_dir, call_id="4.0", writer=writer)
    op = ops.HookAdd(entry=entries.HookEntry(name="h", on=["agent_finished"], command="true"))
    first = ops.handle(op, ctx)
    again = ops.handle(op, ctx)  # a crash after the effect, before the result: run again
    assert first.result["changed"] is True and again.result["changed"] is False  # type: ignore[union-attr]
    assert len(store.history(state_dir, "hooks")) == 1
    removed = ops.handle(ops.HookRemove(name="h"), ctx.__class__(**{**ctx.__dict__,
                                                                     "call_id": "5.0"}))
    assert removed.result["entries"] == []  # type: ignore[union-attr]
    missing = ops.handle(ops.HookRemove(name="h"), ctx.__class__(**{**ctx.__dict__,
                                                                     "call_id": "6.0"}))
    assert missing.ok is False and "no entry 'h'" in missing.result["error"]  # type: ignore[union-attr]


def test_a_change_cut_after_its_append_is_named_from_the_stream(state_dir: StateDir) -> None:
    writer = FakeWriter().as_origin("operator")
    store.commit(state_dir, writer, "mcp", ops.put({"name": "a", "command": ["x"]}),
                 key="k1", op="mcp_install", actor="operator")
    # cut: the next change wrote its file and its fact, and died before the rename
    folder = store.directory(state_dir, "mcp")
    gen, _ = store.commit(state_dir, writer, "mcp", ops.put({"name": "b", "command": ["y"]}),
                          key="k2", op="mcp_install", actor="operator")
    (folder / f"{gen.seq:020d}.json").rename(folder / f"pending-{gen.sha256}.json")
    (folder / f"pending-{'0' * 64}.json").write_text("{}")  # cut before its append
    assert store.newest(state_dir, "mcp").names() == ["a"]
    third, _ = store.commit(state_dir, writer, "mcp", ops.put({"name": "c", "command": ["z"]}),
                            key="k3", op="mcp_install", actor="operator")
    assert [g.seq for g in store.history(state_dir, "mcp")][-2:] == [gen.seq, third.seq]
    assert third.names() == ["a", "b", "c"]
    assert not list(folder.glob("pending-*"))


def test_a_rule_denies_a_registry_op(state_dir: StateDir, tmp_path: Path) -> None:
    writer = FakeWriter()
    task = write_task(tmp_path / "t.yaml", [
        {"op": "mcp_install", "entry": {"name": "files", "command": ["mcp-files"]}},
        {"op": "finish", "summary": "done"}])
    run_agent(state_dir, writer, task, rules=[Rule(op="mcp_install", decision="deny")])
    results = [p for e, p in writer.events("agent/a1") if e == "tool_result"]
    assert results[0]["status"] == "denied"
    assert store.history(state_dir, "mcp") == []


def test_the_readers_read_what_the_ops_wrote_and_a_schedule_is_owned_by_its_caller(
        state_dir: StateDir, tmp_path: Path) -> None:
    """One format, written and read by the store: what the ops committed is
    what the scheduler, the hook deliverer and procs' MCP bridge load; a
    schedule's owner is the agent that added it, whatever its entry claimed."""
    writer = FakeWriter()
    forged = {"name": "esc", "cron": "*/5 * * * * *", "task": "/t.yaml", "owner": "operator"}
    run_agent(state_dir, writer, write_task(tmp_path / "t.yaml", [
        {"op": "schedule_add", "entry": forged},
        {"op": "hook_add", "entry": {"name": "h", "on": ["agent_finished"], "command": "true"}},
        {"op": "mcp_install", "entry": {"name": "m", "command": ["srv"]}},
        {"op": "finish", "summary": "done"}]))
    assert store.newest_seq(state_dir, "schedules") > 0
    schedules = store.load_schedules(state_dir)
    assert list(schedules) == ["esc"] and schedules["esc"].owner == "a1"
    assert store.load_hooks(state_dir)["h"].command == "true"
    assert store.load_mcp(state_dir)["m"].command == ["srv"]
    view = yaml.safe_load(store.yaml_path(state_dir, "schedules").read_text())
    assert view["entries"][0]["owner"] == "a1"  # the copy for people says the same
