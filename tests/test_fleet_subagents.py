"""An agent's subagent on another host (docs/fleet.md, "Subagents on another
host"): two corral hosts (`supervisor up` each, fleet mode with
`fleet.remote_subagents`) on the real 3-node cluster.

A scripted parent on host A spawns its child with `host: B`; the child runs
on B (B's registry and B's WAL have it, A's do not run it), its change set
comes back over the bridge, is verified and sealed on A, and applies on A
once, leaving the same workspace as the same parent with a local child. A
resent spawn (same parent and key) finds the same remote child. Then the
test plays a third host C (its own bus key, registered; a status entry in
the fleet view) that A places a child on, and answers as C's subagents with
hostile frames: a reply about a child A placed on B, a change set whose bytes
do not match the digest announced, one over its bound, one built on another
base, and offers of its own children whose snapshot has a `..` path or bytes
that are not its digest; each is refused (counted, typed, the child
untouched, nothing run), and A's subagents actor goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from actors.kernel.settings import read_spec
from actors.subagents import remotepack as rp
from actors.subagents.remote import remote_id
from actors.subagents.transfers import chunks
from actors.writer.client import WriterClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from supervisor.fleet import buskeys
from supervisor.fleet.bridge import bus_key, bus_subject, sign
from supervisor.fleet.natsclient import HOSTS_BUCKET
from tests.agentkit import tree, write_task
from tests.fleetkit import (
    Cluster,
    FleetKeys,
    forget_hosts,
    operator_key_and_hosts,
    register_bus_key,
)
from tests.processes import ProcessTracker, wait_for
from tests.test_fleet_hosts import cli, fleet_view, host_config, other_state_dir

__all__ = ["other_state_dir"]  # the fixture, used by name

pytestmark = [pytest.mark.fleet, pytest.mark.process]

CHILD_STEPS: list[dict[str, Any]] = [
    {"op": "edit_file", "path": "src/app.py", "old": "greet", "new": "welcome",
     "replace_all": True},
    {"op": "write_file", "path": "docs/NOTES.md", "content": "written by the child\n"},
    {"op": "finish", "summary": "renamed"},
]


def parent_steps(host: str | None) -> list[dict[str, Any]]:
    """The parent writes its child's task into its workspace (a task file
    outside it is refused), then delegates."""
    spawn: dict[str, Any] = {"op": "spawn_subagent", "task": "child.yaml",
                             "descriptor": "renamer", "wait_s": 60}
    if host is not None:
        spawn["host"] = host
    return [
        {"op": "write_file", "path": "src/app.py",
         "content": "def greet():\n    return 'hi'\n\nprint(greet())\n"},
        {"op": "write_file", "path": "README.md", "content": "readme\n"},
        {"op": "write_file", "path": "child.yaml",
         "content": yaml.safe_dump({"name": "child", "steps": CHILD_STEPS})},
        spawn,
        {"op": "subagent_changes", "subagent_id": "latest"},
        {"op": "apply_subagent", "subagent_id": "latest"},
        {"op": "apply_subagent", "subagent_id": "latest"},  # refused: applied once
        {"op": "finish", "summary": "delegated"},
    ]


def remote_config(state_dir: StateDir, host: str, cluster: Cluster, keys: FleetKeys) -> Path:
    """The fleet tests' host configuration, with the subagents actor and remote
    children allowed (and no agents of its own)."""
    path = host_config(state_dir, host, cluster, keys, 0)
    config = yaml.safe_load(path.read_text())
    fast = {k: v for k, v in config["children"][0].items()
            if k not in ("name", "kind", "fatal_exit_codes")}
    config["children"].append({"name": "subagents", "kind": "subagents", **fast})
    config["fleet"]["remote_subagents"] = True
    config["agent"] = {"budget": {"tokens": 123_456, "cost_units": 77.0}}  # bounded
    path.write_text(yaml.safe_dump(config))
    return path


def registry(state_dir: StateDir) -> list[dict[str, Any]]:
    path = state_dir.root / "subagents" / "registry.json"
    return list(json.loads(path.read_text())["children"]) if path.exists() else []


def results(writer: WriterClient, agent: str) -> list[dict[str, Any]]:
    found = [r.payload() for r in writer.read_stream(f"agent/{agent}")
             if r.event == "tool_result"]
    return [p for p in found if isinstance(p, dict)]


def finished(writer: WriterClient, agent: str) -> bool:
    return any(r.event == "session_exit" for r in writer.read_stream(f"agent/{agent}"))


def stats(peer: BrokerPeer, to: str) -> dict[str, Any]:
    reply = peer.request(to, protocol.StatsRequest(msg_id=new_msg_id("st")), timeout_s=5)
    assert isinstance(reply, protocol.Stats)
    return dict(reply.values)


def spawn(peer: BrokerPeer, ws: Path, task: Path, host: str, key: str, *,
          wait_s: float = 0.0) -> protocol.SubagentReply:
    reply = peer.request("subagents", protocol.SpawnSubagent(
        msg_id=new_msg_id("sa"), parent="probe", workspace=str(ws), task=str(task),
        key=key, host=host, wait_s=wait_s), timeout_s=wait_s + 10, retries=0)
    assert isinstance(reply, protocol.SubagentReply), reply
    return reply


def changes(peer: BrokerPeer, subagent_id: str) -> protocol.SubagentReply:
    reply = peer.request("subagents", protocol.SubagentChanges(
        msg_id=new_msg_id("sc"), parent="probe", subagent_id=subagent_id), timeout_s=5)
    assert isinstance(reply, protocol.SubagentReply), reply
    return reply


@pytest.mark.timeout(150)
def test_a_subagent_runs_on_another_host_and_its_change_set_applies_here(
        fleet_cluster: Cluster, processes: ProcessTracker, state_dir: StateDir,
        other_state_dir: StateDir, tmp_path: Path) -> None:
    fleet_cluster.wait_ready()
    keys, ha, hb = operator_key_and_hosts(state_dir.root)
    hc = f"hc{ha[2:]}"  # played by the test
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                         "--config", str(remote_config(state_dir, ha, fleet_cluster, keys))],
                        name="up-a")
        processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(other_state_dir.root),
                         "--config", str(remote_config(other_state_dir, hb, fleet_cluster,
                                                       keys))], name="up-b")

        def both_up() -> bool:
            if not (state_dir.run_dir / "fleet.json").exists():
                return False
            try:
                view = fleet_view(processes, state_dir)
            except Exception:  # noqa: BLE001 - a read timing out on a loaded cluster: again
                return False
            return all(any(c["name"] == "subagents" and c["state"] == "running"
                           for c in view.get(h, {}).get("children", [])) for h in (ha, hb))

        wait_for(both_up, 60, "both hosts' subagents running", interval_s=0.3)
        probe = BrokerPeer(ctx, state_dir, "probe", 0.2, 5)  # an actor of host A
        # B in A's bridge's view: a ping to B's subagents gets there (B's bridge
        # answers `forbidden`: only another host's subagents may talk to it)
        wait_for(lambda: _reaches(probe, f"{hb}:subagents"), 30, "B reachable from A",
                 interval_s=0.3)
        for name, host in (("remote-p", hb), ("local-p", None)):
            task = write_task(tmp_path / f"{name}.yaml", parent_steps(host))
            done = cli(processes, state_dir, "spawn", name, "--task", str(task), "--json")
            assert done.returncode == 0, done.stdout + done.stderr
        with WriterClient(ctx, state_dir, "probe-a") as writer_a, \
                WriterClient(ctx, other_state_dir, "probe-b") as writer_b:
            for name in ("remote-p", "local-p"):
                wait_for(lambda n=name: finished(writer_a, n), 60,  # type: ignore[misc]
                         f"{name} finished", interval_s=0.3)
            remote_ws = state_dir.agent_dir("remote-p") / "workspace"
            local_ws = state_dir.agent_dir("local-p") / "workspace"
            assert tree(remote_ws) == tree(local_ws)  # the same result as a local child
            assert "def welcome()" in (remote_ws / "src/app.py").read_text()
            assert (remote_ws / "docs/NOTES.md").read_text() == "written by the child\n"
            got = results(writer_a, "remote-p")
            assert [(r["op"], r["status"]) for r in got] == [
                ("write_file", "ok"), ("write_file", "ok"), ("write_file", "ok"),
                ("spawn_subagent", "ok"), ("subagent_changes", "ok"), ("apply_subagent", "ok"),
                ("apply_subagent", "error"), ("finish", "ok")], got
            assert got[3]["result"]["status"] == "ready"
            assert {f["path"] for f in got[3]["result"]["files"]} == {"src/app.py",
                                                                       "docs/NOTES.md"}
            assert "already_applied" in got[6]["result"]["error"]
            # the child ran on B, not on A: A's record names B, B's names A
            mine = next(c for c in registry(state_dir) if c["parent"] == "remote-p")
            assert mine["host"] == hb and mine["state"] == "applied" and mine["pid"] is None
            theirs = [c for c in registry(other_state_dir) if c["origin"] == ha]
            assert [c["remote_id"] for c in theirs] == [mine["subagent_id"]]
            assert theirs[0]["subagent_id"] == remote_id(ha, mine["subagent_id"])
            assert finished(writer_b, theirs[0]["name"])  # the child's stream is on B
            assert not list(writer_a.read_stream(f"agent/remote-p.{mine['subagent_id']}"))
            receipt = json.loads((Path(mine["directory"]) / "application.json").read_text())
            assert receipt["changeset_id"] == mine["subagent_id"]
            # the parent's remaining budget went with it, as it goes with a local child
            local_child = next(c for c in registry(state_dir) if c["parent"] == "local-p")
            local_spec = read_spec(state_dir, local_child["name"])
            remote_spec = read_spec(other_state_dir, theirs[0]["name"])
            assert local_spec is not None and remote_spec is not None
            remote_budget, local_budget = remote_spec.settings.budget, local_spec.settings.budget
            # what was left of the parent's (each parent's use differs by a little)
            assert remote_budget.tokens is not None and local_budget.tokens is not None
            assert remote_budget.cost_units is not None and local_budget.cost_units is not None
            assert remote_budget.tokens <= 123_456 and remote_budget.cost_units < 77.0
            assert abs(remote_budget.tokens - local_budget.tokens) < 1000
            assert abs(remote_budget.cost_units - local_budget.cost_units) < 1.0
            sealed = [r.payload() for r in writer_a.read_stream("subagents/remote-p")
                      if r.event == "subagent_ended"]
            assert len(sealed) == 1, sealed
            assert isinstance(sealed[0], dict) and sealed[0]["host"] == hb
            assert sealed[0]["manifest_sha256"]

        # a resent spawn (same parent and key) finds the same remote child
        ws = tmp_path / "ws3"
        (ws / "src").mkdir(parents=True)
        (ws / "src/app.py").write_text("def greet():\n    return 'hi'\n")
        child_task = write_task(ws / "child.yaml", CHILD_STEPS)  # in the workspace
        first = spawn(probe, ws, child_task, hb, "k-resend")
        again = spawn(probe, ws, child_task, hb, "k-resend", wait_s=30)
        assert again.subagent_id == first.subagent_id and again.state == "ended", again
        assert again.manifest is not None and b"src/app.py" in again.manifest
        assert [c["remote_id"] for c in registry(other_state_dir)
                if c["remote_id"] == first.subagent_id] == [first.subagent_id]
        on_b = first.subagent_id
        # a host the fleet does not have: refused, typed (the bridge's host_unreachable)
        unknown = spawn(probe, ws, child_task, f"nohost{hb[2:]}", "k-unknown", wait_s=10)
        assert unknown.state == "failed", unknown
        assert unknown.refusal is not None and "host_unreachable" in unknown.refusal

        # host C, played by the test: A places a child there, C answers with hostile frames
        before = stats(probe, "subagents")["remote_refused_total"]
        offer = asyncio.run(_hostile_host(fleet_cluster.urls, keys, ha, hc, probe, ws,
                                          child_task, on_b, other_state_dir))
        after = stats(probe, "subagents")
        assert after["remote_refused_total"] >= before + 6, (before, after)
        assert after["remote_hosted_total"] == 0  # nothing of C's ran on A
        hostile = changes(probe, offer)
        assert hostile.state == "running" and hostile.manifest is None, hostile
        assert hostile.refusal is not None and "foreign_changeset" in hostile.refusal
        assert changes(probe, on_b).state == "ended"  # the reply "from C" changed nothing
        assert _pong(probe, "subagents")
        probe.close()
    finally:
        ctx.destroy(linger=0)
        for proc in processes.started:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
        forget_hosts(fleet_cluster.urls, [ha, hb, hc])


def _reaches(peer: BrokerPeer, to: str) -> bool:
    try:
        peer.request(to, protocol.Ping(msg_id=f"p{secrets.token_hex(4)}"), timeout_s=1,
                     retries=0)
    except RemoteError as exc:
        return exc.code == "forbidden"
    except RequestTimeoutError:
        return False
    return True


def _pong(peer: BrokerPeer, to: str) -> bool:
    try:
        return isinstance(peer.request(to, protocol.Ping(msg_id=f"p{secrets.token_hex(4)}"),
                                       timeout_s=1, retries=0), protocol.Pong)
    except (RemoteError, RequestTimeoutError):
        return False


async def _hostile_host(urls: list[str], keys: FleetKeys, ha: str, hc: str,  # noqa: PLR0917
                        probe: BrokerPeer, ws: Path, task: Path, on_b: str,
                        other_state_dir: StateDir) -> str:
    """Be host C until A placed a child on it; answer with hostile frames; the
    child's id on A."""
    import nats

    key_c = buskeys.load_or_create(other_state_dir.root.parent / "hc" / buskeys.KEY_FILE)
    secret = bus_key(keys.bus_secret.read_bytes().strip())
    nc: Any = await nats.connect(urls, connect_timeout=2)
    frames: asyncio.Queue[tuple[dict[str, str], protocol.Message]] = asyncio.Queue()

    async def on_frame(msg: Any) -> None:
        await frames.put((dict(msg.headers or {}), protocol.decode(bytes(msg.data))))

    async def send(message: protocol.Message) -> None:
        body = protocol.encode(message)
        await nc.publish(bus_subject(ha), body, headers=sign(
            secret, f"{hc}:subagents", f"{ha}:subagents", body, host_key=key_c))

    try:
        js = nc.jetstream(timeout=5)
        assert await register_bus_key(js, hc, buskeys.public_hex(key_c), 3)
        hosts = await js.key_value(HOSTS_BUCKET)
        await nc.subscribe(bus_subject(hc), cb=on_frame)

        async def alive() -> None:  # C's status entry, kept fresh (the bucket's TTL)
            while True:
                await hosts.put(hc, json.dumps({"host": hc, "at": time.time(),
                                                "children": []}).encode())
                await asyncio.sleep(1)

        keeper = asyncio.get_running_loop().create_task(alive())
        # C is in A's bridge's view once a frame from A reaches C
        deadline = time.monotonic() + 30
        reached = False
        while not reached:
            assert time.monotonic() < deadline, "C never entered A's fleet view"
            probe.send(f"{hc}:subagents", protocol.Ping(msg_id=new_msg_id("c")))
            with contextlib.suppress(TimeoutError):
                reached = isinstance((await asyncio.wait_for(frames.get(), 0.5))[1],
                                     protocol.Ping)
        spawn(probe, ws, task, hc, "k-hostile")
        offer: protocol.SubagentRemote | None = None
        while offer is None:
            assert time.monotonic() < deadline + 10, "A never offered a child to C"
            headers, message = await asyncio.wait_for(frames.get(), 10)
            if isinstance(message, protocol.SubagentRemote) and message.op == "offer":
                assert headers["Corral-From"] == f"{ha}:subagents"
                offer = message
        assert offer.base_sha256 is not None
        cid = offer.subagent_id
        # 1. a reply about the child A placed on B, from C: A did not ask C
        await send(protocol.SubagentRemoteReply(
            msg_id="rr-x", subagent_id=on_b, state="failed", refusal="from C"))
        # 2. a pack whose bytes are not the digest announced
        forged = rp.pack([rp.PackedFile("changeset.json", 0o100644, b"{}")])
        lie = "ab" * 32
        for chunk in chunks(forged):
            await send(chunk.model_copy(update={"pack_sha256": lie}))
        await send(protocol.SubagentRemoteReply(
            msg_id="rr-1", subagent_id=offer.subagent_id, state="ended", exit_code=0,
            pack_sha256=lie, pack_bytes=len(forged)))
        # 3. a pack over any change set's bound (refused at its first chunk)
        await send(protocol.SubagentChunk(pack_sha256="cd" * 32, pack_bytes=64 << 20,
                                          index=0, total=128, data=b"x" * 1024))
        # 4. a well-formed change set, built on another base than the one sent
        manifest = json.dumps({
            "version": 1, "changeset_id": cid, "status": "ready", "created_at": 1.0,
            "base_sha256": "0" * 64, "limits": {}, "files": [], "input_bytes": 0,
            "patch_bytes": 0, "patch_sha256": rp.sha256(b""), "refusal": None}).encode()
        other = rp.pack(rp.changeset_files(manifest, b"", {}))
        for chunk in chunks(other):
            await send(chunk)
        await send(protocol.SubagentRemoteReply(
            msg_id="rr-2", subagent_id=offer.subagent_id, state="ended", exit_code=0,
            pack_sha256=rp.sha256(other), pack_bytes=len(other)))
        await nc.flush()
        # the last one's refusal is on the child once A took all four (in order)
        wait_for(lambda: "foreign_changeset" in str(changes(probe, offer.subagent_id).refusal),
                 10, "A refusing C's change sets", interval_s=0.2)
        # C offers A children of its own (A runs other hosts' children too): a snapshot
        # with a path out of the workspace, and one whose bytes are not its digest
        header = json.dumps({"files": [["../escape", 0o100644, 1, rp.sha256(b"x")]]}).encode()
        escaping = rp.MAGIC + len(header).to_bytes(4, "big") + header + b"x"
        good = rp.pack([rp.PackedFile("a.txt", 0o100644, b"a")])
        answers: dict[str, str | None] = {}
        for name, blob, digest in (("escape", escaping, rp.sha256(escaping)),
                                   ("digest", good, "ef" * 32)):
            for chunk in chunks(blob):
                await send(chunk.model_copy(update={"pack_sha256": digest}))
            await send(protocol.SubagentRemote(
                msg_id=f"off-{name}", op="offer", subagent_id="s-aaaaaaaaaaaa", parent="p",
                pack_sha256=digest, pack_bytes=len(blob), base_sha256="0" * 64,
                task=b"steps: []", settings=b"{}"))
        while len(answers) < 2:
            _, message = await asyncio.wait_for(frames.get(), 10)
            if isinstance(message, protocol.SubagentRemoteReply) and \
                    message.msg_id.startswith("off-"):
                assert message.state == "refused", message
                answers[message.msg_id] = message.refusal
        assert str(answers["off-escape"]).startswith("unsafe_path"), answers
        assert str(answers["off-digest"]).startswith("digest_mismatch"), answers
        keeper.cancel()
        return offer.subagent_id
    finally:
        await nc.close()
