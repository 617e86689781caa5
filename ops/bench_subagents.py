"""`python ops/bench.py subagents`: a 1,000-file workspace, a child that edits
10 files, its change set back at the parent; against `git worktree add` +
the same edits + `git diff --binary`, measured in the same run.

Figures:
    changeset_ms_p50        spawn_subagent sent by the parent (through the broker)
                            to the reply carrying the change set: snapshot of the
                            1,000 files, a real child agent process (forked by
                            the host's zygote; the first run may find it still
                            preloading and wait for it; scripted model, 10
                            edit_file ops and finish, each through the gate and
                            the WAL), the change set built and returned
    changeset_core_ms_p50   the same work as the baseline, in-process: snapshot,
                            the 10 edits, build of the change set (manifest, blobs,
                            patch); no child process; on a copy of the workspace
    changeset_core_cow_ms_p50  the same on an overlay (listing, mount, edits, build,
                            unmount), where this process can mount one
    git_worktree_diff_ms_p50  baseline: `git worktree add --detach`, the 10 edits,
                            `git diff --binary`
    ratio_end_to_end / ratio_core   ours / baseline (target: within 2x)
    patch_applies           our patch passes `git apply --check` on the parent
    file_create_us          what creating one empty file cost in the run's directory
                            before the runs (both sides create 1,000 files a run)

Where `changeset_ms` goes, same runs (medians, from the host's and the child's
log lines):
    phase_snapshot_ms_p50   the request to `subagent_snapshotted` (the host's
                            copy of the 1,000 files, and the parent's record)
    phase_snapshot_copy_ms_p50  of it, the snapshot alone, as the host logs it
                            (`elapsed_ms`): on an overlay the parent's listing and
                            the mount (`overlay.prepare()`), else the copy
                            (`snapshot()`: the files copied and packed, the base
                            index saved)
    phase_child_start_ms_p50  `subagent_snapshotted` to the child's first log
                            line (its fork from the host's zygote, its start)
    phase_child_steps_ms_p50  the child's `session_started` to `session_exited`:
                            its 11 durable turns, each through the gate, the WAL
                            (two durable appends for an edit) and a capture of
                            its 1,000-file workspace (its workspace tree)
    phase_child_end_ms_p50  `session_exited` to `subagent_ended` (the child's
                            exit, reaping, the change set built)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from actors.changesets import overlay, overlaydiff
from actors.changesets.build import build, build_from
from actors.changesets.snapshot import snapshot
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from ops.benchkit import (
    child_env,
    file_create_us,
    percentile,
    stop,
    temp_state_root,
    wait_writer_ready,
)

PARENT = "bench-parent"
N_FILES = 1000
N_EDITS = 10


def _workspace(root: Path) -> Path:
    ws = root / "ws"
    for i in range(N_FILES):
        path = ws / f"pkg{i // 20:02d}" / f"mod{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(40))
        path.write_text(f"# module {i}\n{body}")
    return ws


def _targets() -> list[str]:
    return [f"pkg{i // 20:02d}/mod{i:04d}.py" for i in range(0, N_FILES, N_FILES // N_EDITS)]


def _edit(ws: Path) -> None:
    for rel in _targets():
        path = ws / rel
        path.write_text(path.read_text().replace("return x + 7\n", "return x * 7  # edited\n"))


def _child_task(root: Path) -> Path:
    lines = ["name: bench-child", "steps:"]
    for rel in _targets():
        lines.append(f'  - {{op: edit_file, path: "{rel}", old: "return x + 7\\n", '
                     f'new: "return x * 7  # edited\\n"}}')
    lines.append("  - {op: finish, summary: edited}")
    path = root / "child.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _git(cwd: Path, *args: str) -> bytes:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd),
           "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True,
                          capture_output=True).stdout


def _repo(root: Path, ws: Path) -> Path:
    repo = root / "repo"
    shutil.copytree(ws, repo)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    return repo


def _baseline_once(root: Path, repo: Path, n: int) -> float:
    tree = root / f"wt{n}"
    started = time.perf_counter()
    _git(repo, "worktree", "add", "-q", "--detach", str(tree), "HEAD")
    _edit(tree)
    diff = _git(tree, "diff", "--binary")
    elapsed = (time.perf_counter() - started) * 1000
    assert diff.count(b"diff --git") == N_EDITS
    _git(repo, "worktree", "remove", "--force", str(tree))
    return elapsed


def _core_once(root: Path, ws: Path, n: int) -> float:
    d = root / f"core{n}"
    started = time.perf_counter()
    index = snapshot(ws, d / "base", d / "work")
    _edit(d / "work")
    manifest = build(f"core{n}", index, d / "work", d)
    elapsed = (time.perf_counter() - started) * 1000
    assert manifest.status == "ready"
    assert len(manifest.files) == N_EDITS
    shutil.rmtree(d)
    return elapsed


def _core_cow_once(root: Path, ws: Path, n: int) -> float:
    d = root / f"cow{n}"
    started = time.perf_counter()
    base = overlay.prepare(ws, d)
    try:
        _edit(d / "work")
        manifest = build_from(f"cow{n}", base.digest(),
                              lambda: overlaydiff.diff(base, d / overlay.UPPER, d / "work"), d)
    finally:
        overlay.unmount(d)
    elapsed = (time.perf_counter() - started) * 1000
    assert manifest.status == "ready"
    assert len(manifest.files) == N_EDITS
    shutil.rmtree(d)
    return elapsed


def _spawn(module: str, state: StateDir) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--state-dir", str(state.root)], env=child_env(),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait_peer(peer: BrokerPeer, to: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if isinstance(peer.request(to, protocol.Ping(msg_id=new_msg_id("p")),
                                       timeout_s=0.2, retries=0), protocol.Pong):
                return
        except (RequestTimeoutError, RemoteError):
            continue
    raise TimeoutError(f"{to} did not answer")


def _end_to_end(root: Path, ws: Path, runs: int, sent: list[float],
                before_each: Callable[[int], None] = lambda n: None,
                ) -> tuple[list[float], bytes]:
    state = StateDir(root / ".corral").ensure()
    task = _child_task(ws)  # in the workspace: a task file outside it is refused
    started_procs: list[subprocess.Popen[bytes]] = []
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer: BrokerPeer | None = None
    times: list[float] = []
    patch = b""
    try:
        started_procs.append(_spawn("actors.writer", state))
        wait_writer_ready(state.root)
        started_procs.append(_spawn("broker.server", state))
        started_procs.append(_spawn("actors.subagents", state))
        peer = BrokerPeer(ctx, state, PARENT)
        _wait_peer(peer, "subagents")
        for n in range(runs):
            before_each(n)
            message = protocol.SpawnSubagent(msg_id=new_msg_id("s"), parent=PARENT,
                                              workspace=str(ws), task=str(task),
                                              descriptor="bench", wait_s=60)
            started = time.perf_counter()
            sent.append(time.time())
            reply = peer.request("subagents", message, timeout_s=90, retries=0)
            times.append((time.perf_counter() - started) * 1000)
            assert isinstance(reply, protocol.SubagentReply), reply
            assert reply.state == "ended", reply.refusal
            assert reply.patch is not None
            patch = reply.patch
    finally:
        if peer is not None:
            peer.close()
        ctx.destroy(linger=0)
        for p in reversed(started_procs):
            stop(p)
    return times, patch


def _log_events(path: Path) -> list[tuple[float, str, dict[str, object]]]:
    from datetime import datetime

    out: list[tuple[float, str, dict[str, object]]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            doc = json.loads(line)
            at = datetime.fromisoformat(str(doc["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        out.append((at, str(doc.get("event")), doc))
    return out


def phases(state: StateDir, requested: list[float]) -> dict[str, list[float]]:
    """Per run, the phases of `changeset_ms` (see the module's docstring):
    `requested` are the wall-clock times the requests were sent."""
    host = _log_events(state.logs_dir / "subagents.log")
    out: dict[str, list[float]] = {"snapshot": [], "snapshot_copy": [], "child_start": [],
                                   "child_steps": [], "child_end": []}
    snapped = [(at, str(doc.get("subagent_id")), doc.get("elapsed_ms")) for at, ev, doc in host
               if ev == "subagent_snapshotted"]
    ended = {str(doc.get("subagent_id")): at for at, ev, doc in host if ev == "subagent_ended"}
    for sent, (snap_at, sid, copy_ms) in zip(requested, snapped, strict=False):
        child = _log_events(state.logs_dir / f"{PARENT}.{sid}.log")
        started = [at for at, ev, _ in child if ev == "session_started"]
        exited = [at for at, ev, _ in child if ev == "session_exited"]
        if not (child and started and exited and sid in ended):
            continue
        out["snapshot"].append((snap_at - sent) * 1000)
        if isinstance(copy_ms, int | float):
            out["snapshot_copy"].append(float(copy_ms))
        out["child_start"].append((child[0][0] - snap_at) * 1000)
        out["child_steps"].append((exited[-1] - started[0]) * 1000)
        out["child_end"].append((ended[sid] - exited[-1]) * 1000)
    return out


def run(quick: bool = False) -> dict[str, object]:
    runs = 3 if quick else 7
    with temp_state_root() as root:
        create_us = file_create_us(root)
        ws = _workspace(root)
        repo = _repo(root, ws)
        baseline: list[float] = []
        core: list[float] = []
        core_cow: list[float] = []
        cow = overlay.probe(root / "cow-probe") is None

        def peers(n: int) -> None:
            baseline.append(_baseline_once(root, repo, n))
            core.append(_core_once(root, ws, n))
            if cow:
                core_cow.append(_core_cow_once(root, ws, n))

        # interleaved, a run of each in turn: all three see the same disk
        # weather (here a file's create grows slower as a run creates and
        # removes thousands, docs/performance.md)
        sent: list[float] = []
        e2e, patch = _end_to_end(root, ws, runs, sent, peers)
        parts = phases(StateDir(root / ".corral"), sent)
        (root / "ours.patch").write_bytes(patch)
        check = subprocess.run(["git", "apply", "--check", str(root / "ours.patch")], cwd=ws,
                               capture_output=True, check=False)
    base_p50 = percentile(baseline, 50)
    return {
        "files": N_FILES,
        "edited": N_EDITS,
        "runs": runs,
        "changeset_ms_p50": round(percentile(e2e, 50), 1),
        "changeset_core_ms_p50": round(percentile(core, 50), 1),
        **({"changeset_core_cow_ms_p50": round(percentile(core_cow, 50), 1)} if core_cow else {}),
        "git_worktree_diff_ms_p50": round(base_p50, 1),
        "ratio_end_to_end": round(percentile(e2e, 50) / base_p50, 2),
        "ratio_core": round(percentile(core, 50) / base_p50, 2),
        "patch_applies": check.returncode == 0,
        "patch_sha256": hashlib.sha256(patch).hexdigest()[:16],
        "file_create_us": round(create_us, 1),
        **{f"phase_{name}_ms_p50": round(percentile(times, 50), 1)
           for name, times in parts.items() if times},
    }
