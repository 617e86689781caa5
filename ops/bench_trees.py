"""`python ops/bench.py trees --json`: what workspace trees cost.

A workspace of 10,000 files (100 directories x 7 subdirectories); each round
changes 10 files, then times, on that same change:

- `tree_capture_ms`: actors/trees `Capturer.capture()` (the stat cache walk,
  the 10 changed files hashed, one durable pack with their blobs and the
  tree: file fsync + directory fsync), what the agent does at a turn boundary;
- `git_tree_ms`: `git add -A && git write-tree` on the same workspace (its
  git directory outside the workspace), git's index being its stat cache;
- `git_durable_tree_ms`: the same with git made as durable as the capture
  (`-c core.fsync=all -c core.fsyncMethod=fsync`, its own git directory):
  git's defaults fsync neither its loose objects nor its index, so the
  default run does less than the capture, which fsyncs its pack and its
  directory before a fact may name the tree;
- `watched_capture_ms`: the same capture by a capturer that watches the
  workspace (actors/trees/watch.py), as an agent's does: it reads the
  changed names from inotify's queue instead of lstat'ing 10,000 entries,
  and still walks in full at least once a second (`watched_full_walks`
  counts the walks among its captures); its own store and cache, its digest
  checked against the walk's;
- `rewind_ms`: restoring the previous round's tree over this one (the 10
  files back, durably), including the walk that captures the current tree
  first, as `supervisor rewind` does (`rewind_restore_only_ms` is the
  restore alone). CPU times (`*_cpu_ms`) and the load average are printed
  too: on a shared machine wall time is mostly waiting for a core.

Then, what the store grows by (issue 34): `growth_turns` (200) turns each
rewrite one 1 KiB file (random bytes: nothing to compress) of a 1,000-file
directory, each captured: `pack_bytes_per_turn` is the packs' growth over
those turns, `changed_bytes_per_turn` the bytes the turns wrote. git makes
the same 200 commits in the same run: `git count-objects -v` after them
(`git_bytes_per_commit_loose`: its loose objects, zlib'ed, as disk usage)
and after `git gc` (`git_bytes_per_commit_packed`: the pack's growth, with
its deltas), both against the repository as `git gc` left it after the
first commit.

Targets (issue 13): tree_capture_ms_p50 <= git_tree_ms_p50; rewind_ms_p50 <= 200.
Issue 34: pack_bytes_per_turn <= 4 x changed_bytes_per_turn.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from actors.trees import restore
from actors.trees.capture import Capturer
from actors.trees.statcache import StatCache
from actors.trees.store import ObjectStore
from actors.trees.watch import WorkspaceWatch

PLAIN_GIT = "git add -A && git write-tree"
DURABLE_GIT = ("git -c core.fsync=all -c core.fsyncMethod=fsync add -A && "
               "git -c core.fsync=all -c core.fsyncMethod=fsync write-tree")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _populate(ws: Path, files: int) -> list[Path]:
    paths = []
    for i in range(files):
        d = ws / f"d{i % 100:03d}" / f"s{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"f{i:05d}.txt"
        p.write_bytes(f"file {i}\n".encode() * 20)
        paths.append(p)
    return paths


def run(quick: bool = False) -> dict[str, object]:
    files = 2000 if quick else 10_000
    rounds = 5 if quick else 11
    changed = 10
    git = shutil.which("git")
    with tempfile.TemporaryDirectory(prefix="corral-bench-trees-") as tmp:
        root = Path(tmp)
        ws = root / "ws"
        paths = _populate(ws, files)
        store = ObjectStore(root / "state" / "trees" / "packs")
        capturer = Capturer(ws, store, StatCache.load(root / "state" / "cache" / "trees.jsonl"))
        first = capturer.capture()
        watched = Capturer(ws, ObjectStore(root / "watched" / "trees" / "packs"),
                           StatCache.load(root / "watched" / "cache" / "trees.jsonl"),
                           watch=WorkspaceWatch.open())
        watched.capture()
        watched_ms: list[float] = []
        env = {**os.environ, "GIT_DIR": str(root / "git"), "GIT_WORK_TREE": str(ws)}
        durable_env = {**env, "GIT_DIR": str(root / "git-durable")}
        if git:
            for e in (env, durable_env):
                subprocess.run([git, "init", "-q"], env=e, check=True)
                subprocess.run(DURABLE_GIT if e is durable_env else PLAIN_GIT, shell=True,
                               env=e, check=True, stdout=subprocess.DEVNULL)
        capture_ms, git_ms, rewind_ms, hashed = [], [], [], []
        git_durable_ms: list[float] = []
        restore_ms, rewind_cpu_ms, capture_cpu_ms, git_cpu_ms = [], [], [], []
        previous = first.digest
        for r in range(rounds):
            for k in range(changed):
                p = paths[(r * 997 + k * 131) % files]
                with open(p, "ab") as f:
                    f.write(f"round {r}\n".encode())
            started = time.perf_counter()
            cpu = time.process_time()
            got = capturer.capture()
            capture_ms.append((time.perf_counter() - started) * 1000)
            capture_cpu_ms.append((time.process_time() - cpu) * 1000)
            hashed.append(got.hashed)
            started = time.perf_counter()
            seen = watched.capture()
            watched_ms.append((time.perf_counter() - started) * 1000)
            if seen.digest != got.digest:
                raise RuntimeError(f"the watched capture gave {seen}, the walk {got}")
            if git:
                started = time.perf_counter()
                children = _children_cpu_s()
                subprocess.run(PLAIN_GIT, shell=True, env=env, check=True,
                               stdout=subprocess.DEVNULL)
                git_ms.append((time.perf_counter() - started) * 1000)
                git_cpu_ms.append((_children_cpu_s() - children) * 1000)
                started = time.perf_counter()
                subprocess.run(DURABLE_GIT, shell=True, env=durable_env, check=True,
                               stdout=subprocess.DEVNULL)
                git_durable_ms.append((time.perf_counter() - started) * 1000)
            # rewind: capture where we are, restore the previous round's tree
            started = time.perf_counter()
            cpu = time.process_time()
            now = capturer.capture()
            captured = time.perf_counter()
            done = restore.restore(ws, store, now.digest, previous)
            rewind_ms.append((time.perf_counter() - started) * 1000)
            restore_ms.append((time.perf_counter() - captured) * 1000)
            rewind_cpu_ms.append((time.process_time() - cpu) * 1000)
            if now.digest != got.digest or done.written != changed:
                raise RuntimeError(f"rewind restored {done}, capture {now} != {got}")
            # and forward again, so the next round starts from this round's tree
            restore.restore(ws, store, previous, got.digest)
            capturer.capture()
            watched.capture()
            previous = got.digest
        watched_walks = watched.full_walks
        watched.close()
    cap = statistics.median(capture_ms)
    figures: dict[str, object] = {
        "files": files, "changed_per_round": changed, "rounds": rounds,
        "tree_capture_ms_p50": round(cap, 2),
        "tree_capture_ms_max": round(max(capture_ms), 2),
        "hashed_per_capture_p50": statistics.median(hashed),
        "watched_capture_ms_p50": round(statistics.median(watched_ms), 2),
        "watched_full_walks": watched_walks,
        "watched_captures": 2 * rounds + 1,
        "rewind_ms_p50": round(statistics.median(rewind_ms), 2),
        "rewind_ms_max": round(max(rewind_ms), 2),
        "rewind_restore_only_ms_p50": round(statistics.median(restore_ms), 2),
        "rewind_cpu_ms_p50": round(statistics.median(rewind_cpu_ms), 2),
        "tree_capture_cpu_ms_p50": round(statistics.median(capture_cpu_ms), 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    targets: dict[str, bool] = {"rewind_ms_p50<=200": statistics.median(rewind_ms) <= 200}
    if git_ms:
        g = statistics.median(git_ms)
        figures["git_tree_ms_p50"] = round(g, 2)
        figures["capture_ratio_vs_git"] = round(cap / g, 3)
        figures["git_tree_cpu_ms_p50"] = round(statistics.median(git_cpu_ms), 2)
        targets["tree_capture_ms_p50<=git_tree_ms_p50"] = cap <= g
        d = statistics.median(git_durable_ms)
        figures["git_durable_tree_ms_p50"] = round(d, 2)
        figures["capture_ratio_vs_durable_git"] = round(cap / d, 3)
    growth = _growth(GROWTH_TURNS, git)
    figures.update(growth)
    ratio = growth["pack_bytes_per_turn"] / growth["changed_bytes_per_turn"]
    figures["pack_ratio_vs_changed"] = round(ratio, 3)
    targets["pack_bytes_per_turn<=4x_changed_bytes_per_turn"] = ratio <= 4
    figures["targets"] = targets
    return figures


GROWTH_FILES = 1000
GROWTH_TURNS = 200
GROWTH_FILE_BYTES = 1024
GIT_ID = ["-c", "user.name=bench", "-c", "user.email=bench@localhost", "-c", "gc.auto=0"]


def _git_kib(git: str, env: dict[str, str]) -> tuple[int, int]:
    """(loose, packed) KiB as `git count-objects -v` says."""
    out = subprocess.run([git, "count-objects", "-v"], env=env, check=True,
                         capture_output=True, text=True).stdout
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return int(fields["size"]), int(fields["size-pack"])


def _pack_bytes(packs: Path) -> int:
    return sum(p.stat().st_size for p in packs.glob("*.pack"))


def _growth(turns: int, git: str | None) -> dict[str, float]:
    """Each turn rewrites one 1 KiB file of a 1,000-file directory and
    captures (and commits, with git): the growth of the packs a turn."""
    rnd = random.Random(34)
    with tempfile.TemporaryDirectory(prefix="corral-bench-growth-") as tmp:
        root = Path(tmp)
        ws = root / "ws"
        (ws / "big").mkdir(parents=True)
        (ws / "README").write_text("one large directory\n")
        paths = [ws / "big" / f"f{i:04d}.txt" for i in range(GROWTH_FILES)]
        for p in paths:
            p.write_bytes(rnd.randbytes(GROWTH_FILE_BYTES))
        packs = root / "state" / "trees" / "packs"
        capturer = Capturer(ws, ObjectStore(packs, "bench"),
                            StatCache.load(root / "state" / "cache" / "trees.jsonl"))
        capturer.capture()
        env = {**os.environ, "GIT_DIR": str(root / "git"), "GIT_WORK_TREE": str(ws)}
        if git:
            subprocess.run([git, "init", "-q"], env=env, check=True)
            subprocess.run(f"git add -A && git {' '.join(GIT_ID)} commit -q -m start",
                           shell=True, env=env, check=True)
            subprocess.run([git, *GIT_ID, "gc", "-q"], env=env, check=True)
            loose0, packed0 = _git_kib(git, env)
        before = _pack_bytes(packs)
        changed = 0
        for turn in range(turns):
            data = rnd.randbytes(GROWTH_FILE_BYTES)
            rnd.choice(paths).write_bytes(data)
            changed += len(data)
            capturer.capture()
            if git:
                subprocess.run(f"git add -A && git {' '.join(GIT_ID)} commit -q -m t{turn}",
                               shell=True, env=env, check=True)
        out: dict[str, float] = {
            "growth_files": GROWTH_FILES, "growth_turns": turns,
            "pack_bytes_per_turn": round((_pack_bytes(packs) - before) / turns, 1),
            "changed_bytes_per_turn": round(changed / turns, 1),
        }
        if git:
            loose1, packed1 = _git_kib(git, env)
            subprocess.run([git, *GIT_ID, "gc", "-q"], env=env, check=True)
            loose2, packed2 = _git_kib(git, env)
            out["git_bytes_per_commit_loose"] = round(
                ((loose1 - loose0) + (packed1 - packed0)) * 1024 / turns, 1)
            out["git_bytes_per_commit_packed"] = round(
                ((loose2 - loose0) + (packed2 - packed0)) * 1024 / turns, 1)
    return out
