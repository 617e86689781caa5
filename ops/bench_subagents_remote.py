"""A subagent on another host against one on the parent's own host (`python
ops/bench.py subagents-remote --json`; docs/fleet.md, "Subagents on another
host"): spawn to change set at the parent's host, for a scripted child that
edits 10 files of a workspace of FILES files, placed on host B (its snapshot
packed and sent over the brokers' bridges and a local 3-node NATS cluster,
its change set sent back and verified) and on host A itself, interleaved in
the same run with the same workspace and child.

Each host is a writer, a broker with its bridge (fleet mode) and a subagents
actor with `--remote-subagents`; the fleet view's entries are put by the
benchmark (no supervisors), as in ops/bench_bridge.py.

Figures: `local_changeset_ms_p50`, `remote_changeset_ms_p50` (and p90s),
`remote_ratio_p50` (remote / local), `snapshot_files`, `snapshot_bytes`,
`rounds`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
import zmq

from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from ops.bench_bridge import bridged_broker, fleet_hosts
from ops.bench_broker import _spawn, _stop, _wait_pong
from ops.benchkit import percentile

EDITS = 10


def _workspace(root: Path, files: int) -> int:
    total = 0
    for i in range(files):
        path = root / f"d{i % 20}" / f"f{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = (f"line {i}\n" * 100).encode()
        path.write_bytes(data)
        total += len(data)
    return total


def _spawn_child(peer: BrokerPeer, ws: Path, task: Path, host: str | None) -> float:
    began = time.perf_counter()
    reply = peer.request("subagents", protocol.SpawnSubagent(
        msg_id=new_msg_id("sa"), parent="bench", workspace=str(ws), task=str(task),
        key=f"k{secrets.token_hex(6)}", host=host, wait_s=120), timeout_s=130, retries=0)
    elapsed = (time.perf_counter() - began) * 1000
    if not (isinstance(reply, protocol.SubagentReply) and reply.state == "ended"
            and reply.manifest is not None and b'"ready"' in reply.manifest):
        raise RuntimeError(f"the child did not end with a ready set: {reply!r}"[:500])
    return elapsed


def run(quick: bool = False) -> dict[str, object]:
    from supervisor.fleet import cluster

    files = 100 if quick else 1_000
    rounds = 3 if quick else 10
    root = Path(tempfile.mkdtemp(prefix="csr-", dir="/tmp"))
    procs: list[Any] = []
    cluster_root = root / "cluster" / ".corral"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        urls, key, states = fleet_hosts(root, ("sha", "shb"))
        for host, state in states.items():
            quiet = ["--state-dir", str(state.root), "--log-level", "warning"]
            procs.append(_spawn(["-m", "actors.writer", *quiet], root / f"w-{host}.out"))
            procs.append(_spawn(bridged_broker(state, host, urls, key), root / f"b-{host}.out"))
            procs.append(_spawn(["-m", "actors.subagents", *quiet, "--fleet-host", host,
                                 "--remote-subagents"], root / f"s-{host}.out"))
        ws = root / "ws"
        size = _workspace(ws, files)
        task = ws / "child.yaml"  # in the workspace: a task file outside it is refused
        task.write_text(yaml.safe_dump({"name": "child", "steps": [
            *({"op": "edit_file", "path": f"d{i % 20}/f{i}.txt", "old": f"line {i}\n",
               "new": f"edited {i}\n"} for i in range(EDITS)),
            {"op": "finish", "summary": "edited"}]}))
        peer = BrokerPeer(ctx, states["sha"], "bench")
        _wait_pong(peer, "subagents")
        deadline = time.monotonic() + 30
        while True:  # B's subagents reachable through the bridges (it answers forbidden)
            try:
                peer.request("shb:subagents", protocol.Ping(msg_id=new_msg_id("p")),
                             timeout_s=1, retries=0)
                break
            except RemoteError as exc:  # forbidden: it got there (the answer we wait for)
                if exc.code == "forbidden":
                    break
                if time.monotonic() > deadline:
                    raise
            except RequestTimeoutError:
                if time.monotonic() > deadline:
                    raise
        _spawn_child(peer, ws, task, None)  # warm-up: zygotes forked, files cached
        _spawn_child(peer, ws, task, "shb")
        local: list[float] = []
        remote: list[float] = []
        for _ in range(rounds):
            local.append(_spawn_child(peer, ws, task, None))
            remote.append(_spawn_child(peer, ws, task, "shb"))
        peer.close()
        figures: dict[str, object] = {
            "snapshot_files": files, "snapshot_bytes": size, "rounds": rounds,
            "local_changeset_ms_p50": round(percentile(local, 50), 1),
            "local_changeset_ms_p90": round(percentile(local, 90), 1),
            "remote_changeset_ms_p50": round(percentile(remote, 50), 1),
            "remote_changeset_ms_p90": round(percentile(remote, 90), 1),
        }
        figures["remote_ratio_p50"] = round(percentile(remote, 50) / percentile(local, 50), 2)
        return figures
    finally:
        ctx.destroy(linger=0)
        _stop(procs)
        cluster.down(cluster_root)
        if not os.environ.get("CORRAL_BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)
