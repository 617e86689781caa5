"""`bench.py step`: the cost of one durable agent step, on corral and on two
peers doing the same work in the same run.

The work: one agent takes 200 steps; each step writes one file (the same
`workspace.apply_write` for all three: temp file, fsync, rename, directory
fsync); nothing of a step is lost or done twice by a crash once the next
step's effect has begun.

- corral: a real writer process (fsync on every commit) and the real agent
  loop (actors/agent/loop.py, `AgentLoop.step()`) with the scripted model, one
  OS process per agent, as the supervisor runs them. A step is one model turn
  (`turn`, `tool_call`, `permission`, `tool_start`, the write, `tool_result`);
  the intent and the step before's `tool_result` are one group, durable
  before the write (docs/agents.md: one durable wait a step). A crash before
  the next group loses the step's `tool_result`, and recovery settles the
  call from its recorded digests as applied: never written twice.
- LangGraph: a graph whose one node writes one file per super-step, looping on
  itself; `SqliteSaver` checkpointer (SQLite in WAL mode, which it sets), with
  `PRAGMA synchronous=FULL` set on the connection and `durability="sync"`, so
  every super-step's checkpoint is committed before the next starts
  (LangGraph's default `async` durability would not wait for it).
- DBOS: a workflow whose steps write one file each (`@DBOS.step`), with a
  SQLite system database (DBOS's rollback-journal default) and
  `PRAGMA synchronous=FULL` set on every connection; DBOS records each step's
  output before the workflow goes on.

- corral_notree (a decomposition, not a peer): the same corral run with the
  loop's workspace-tree capture at each turn boundary switched off (the
  tree behind `rewind`/`fork` of the workspace, which neither peer keeps),
  so what that feature costs a step is read in the same run. Its two
  parts are timed in the corral run itself: `corral_tree_capture_cpu_us_p50`
  (the capture's CPU on the loop's thread, a boundary) and
  `corral_tree_sync_wait_us_per_step` (the loop's wait for the pack's
  fdatasync that its thread did not overlap: a second flush of the disk a
  step, which the `*_sync_floor_ms_p50` figures show on the disk alone).
- `cpu_ms_per_step_for_2x_on_2_cores`: the CPU a step (all of a system's
  processes) at which this machine's two cores could run 2x the better
  peer's 8-agent rate at all; against `corral_cpu_ms_per_step_8`.

A step's time is the interval between the starts of two consecutive steps
(everything a step pays, durable records included); `*_step_ms_p50` is their
median with one agent. The systems take turns, for 3 rounds (`--quick`: 2),
and each figure pools its rounds, so a change of the machine's load falls on
all of them alike. With 8 agents at once (`*_steps_per_s_8`: all steps
over the wall time): corral runs 8 agent processes against one writer; each
peer runs 8 threads in one process over one database, its documented way of
running concurrent graphs / workflows.

Each system runs in a fresh child process (`python -m ops.bench_step
--worker ...`) that prints its timings as JSON. The peers come from the
optional extra `bench` (`pip install -e '.[bench]'`); a peer that is not
installed is skipped, with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

import psutil

from ops.benchkit import (
    child_env,
    file_create_us,
    percentile,
    start_writer,
    stop,
    temp_state_root,
    wait_writer_ready,
)

STEPS = 200
AGENTS = 8
ROUNDS = 3  # each system's runs, alternating with the others'


def _write(directory: Path, name: str, step: int) -> None:
    """The agent's own file write (temp file, fsync, rename, directory fsync)."""
    from actors.kernel.workspace import apply_write, place

    apply_write(place(directory, name), f"step {step}\n".encode())


def _wait_go() -> None:
    """Start barrier: a worker says it is ready, then waits for `go` on stdin,
    so that concurrent workers step at the same time (imports on a loaded
    machine take seconds and would otherwise spread their starts)."""
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()


def _intervals_ms(starts: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(starts)]


# --- corral ------------------------------------------------------------------------


def corral_worker(state_root: Path, agent: str, steps: int, *,
                  barrier: bool = True, trees: bool = True) -> dict[str, Any]:
    """One agent process: run the real loop until the session is over
    (`barrier`: wait for `go` on stdin before the first step; `trees`: False
    skips the workspace-tree capture at turn boundaries, for corral_notree)."""
    import zmq

    from actors.agent.loop import AgentLoop, Step
    from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
    from actors.writer.client import WriterClient
    from broker import logconfig
    from broker.statedir import StateDir

    state_dir = StateDir.at(state_root)
    logconfig.configure(agent, state_dir.log_path(agent), console=False)  # as agents do
    task = state_root / f"{agent}.yaml"
    task.write_text(json.dumps({"name": "bench", "repeat": steps, "steps": [
        {"op": "write_file", "path": "out/f{i}.txt", "content": "step {i}\n"}]}))
    spec = AgentSpec(task=str(task), settings=AgentSettings(max_turns=10**6))
    write_spec(state_dir, agent, spec)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    starts: list[float] = []
    capture_us: list[float] = []
    sync_wait_us: list[float] = []
    try:
        with WriterClient(ctx, state_dir, agent, timeout_s=30) as writer:
            loop = AgentLoop(agent, state_dir, spec, writer)
            if not trees:
                loop._record_tree = lambda: False  # type: ignore[method-assign]
            else:
                capture_us, sync_wait_us = _time_the_tree(loop.trees)
            loop.rebuild()
            if barrier:
                _wait_go()
            cpu = time.process_time()
            began = time.perf_counter()
            turn = loop.state.turn
            while True:
                now = time.perf_counter()
                result = loop.step()
                if loop.state.turn != turn:
                    turn = loop.state.turn
                    starts.append(now)
                if result is Step.DONE:
                    break
                if result is Step.WAIT:
                    raise RuntimeError("the benchmark agent waited for an operator")
            wall = time.perf_counter() - began
            ended = time.time()
            cpu = time.process_time() - cpu
        written = len(list((loop.workspace / "out").iterdir()))
    finally:
        ctx.destroy(linger=0)
    # the last turn is the scripted model's `finish`: its start closes the last step
    return {"step_ms": _intervals_ms(starts[: steps + 1]), "wall_s": wall, "steps": steps,
            "files": written, "ended_at": ended, "cpu_s": cpu,
            "tree_capture_us": capture_us, "tree_sync_wait_us": sum(sync_wait_us)}


def _time_the_tree(trees: Any) -> tuple[list[float], list[float]]:
    """Wrap the loop's tree recorder (actors/trees/recorder.py) so the run
    says what the tree costs a step: the capture's CPU on the loop's thread
    (`fact`: the walk or the watched update, the objects appended to the
    pack) and the time the loop waited for the pack's fdatasync before the
    group naming the tree went out (`settle`: the part the sync's thread did
    not overlap)."""
    capture_us: list[float] = []
    sync_wait_us: list[float] = []
    fact, settle = trees.fact, trees.settle

    def timed_fact(state: Any) -> Any:
        began = time.thread_time()
        try:
            return fact(state)
        finally:
            capture_us.append((time.thread_time() - began) * 1e6)

    def timed_settle() -> None:
        began = time.perf_counter()
        try:
            settle()
        finally:
            sync_wait_us.append((time.perf_counter() - began) * 1e6)

    trees.fact, trees.settle = timed_fact, timed_settle
    return capture_us, sync_wait_us


def run_corral(agents: int, steps: int, system: str = "corral") -> dict[str, Any]:
    from broker.statedir import StateDir

    with temp_state_root() as root:
        state = StateDir(root / ".corral").ensure()
        writer = start_writer(state.root)
        try:
            wait_writer_ready(state.root)
            proc = psutil.Process(writer.pid)
            before = proc.cpu_times()
            outs = _run_workers([[system, str(state.root), f"agent-{i}", str(steps)]
                                 for i in range(agents)])
            after = proc.cpu_times()
        finally:
            stop(writer)
    merged = _merge(outs, agents, steps)
    # the writer's CPU over the whole run (its idle start-up is negligible)
    merged["writer_cpu_s"] = (after.user + after.system) - (before.user + before.system)
    return merged


# --- the disk's floor under a step ---------------------------------------------------

FLOOR_ROUNDS = 100  # each system's floor, alternating, per round of the benchmark


def _append_sync(fd: int, data: bytes) -> None:
    os.write(fd, data)
    os.fdatasync(fd)


def sync_floor_ms(directory: Path, rounds: int) -> dict[str, list[float]]:
    """The synchronous disk work alone of one step, no CPU work around it, on
    the disk the runs use, alternating so that load falls on all alike (each
    is the calls a step makes, as strace shows them):

    - corral: the effect journal's line (an append, not synced: docs/agents.md),
      the workspace tree's new objects appended to the agent's pack and
      fdatasynced (the loop starts that sync at the turn boundary and waits for
      it before the group that names the tree goes out: in the real step it
      overlaps the next turn's CPU work, here it does not), an append +
      fdatasync of the WAL (the group: the step before's tool_result, turn ..
      tool_start), the file (temp, fsync, rename, directory fsync);
    - corral_notree: the same without the tree's pack (the corral_notree run);
    - LangGraph (SQLite WAL, synchronous=FULL): the file, then one append +
      fsync of the WAL at the checkpoint's commit.
    """
    wal = os.open(directory / "wal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    journal = os.open(directory / "journal.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                      0o600)
    pack = os.open(directory / "agent.pack", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    record, objects = b"x" * 600, b"t" * 2900  # a group's bytes; a 200-entry tree object's
    times: dict[str, list[float]] = {"corral": [], "corral_notree": [], "langgraph": []}
    try:
        for i in range(rounds):
            started = time.perf_counter()
            os.write(journal, record[:240])
            _append_sync(pack, objects)
            _append_sync(wal, record)
            _write(directory, f"c{i}.txt", i)
            times["corral"].append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            os.write(journal, record[:240])
            _append_sync(wal, record)
            _write(directory, f"n{i}.txt", i)
            times["corral_notree"].append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            _write(directory, f"l{i}.txt", i)
            _append_sync(wal, record)
            times["langgraph"].append((time.perf_counter() - started) * 1000)
    finally:
        for fd in (wal, journal, pack):
            os.close(fd)
    return times


# --- LangGraph ---------------------------------------------------------------------


class State(TypedDict):
    """The LangGraph graph's state: the next step and the output directory."""

    step: int
    out: str


def langgraph_worker(directory: Path, threads: int, steps: int) -> dict[str, Any]:
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    conn = sqlite3.connect(directory / "checkpoints.sqlite", check_same_thread=False)
    saver = SqliteSaver(conn)
    saver.setup()  # sets journal_mode=WAL
    conn.execute("PRAGMA synchronous=FULL")
    sync_mode = conn.execute("PRAGMA synchronous").fetchone()[0]
    journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
    starts: dict[str, list[float]] = {}

    def write(state: State) -> dict[str, Any]:
        starts.setdefault(state["out"], []).append(time.perf_counter())
        _write(Path(state["out"]), f"f{state['step']}.txt", state["step"])
        return {"step": state["step"] + 1}

    def more(state: State) -> str:
        return "write" if state["step"] < steps else END

    builder = StateGraph(State)
    builder.add_node("write", write)
    builder.add_edge(START, "write")
    builder.add_conditional_edges("write", more)
    graph = builder.compile(checkpointer=saver)

    def one(index: int) -> None:
        out = directory / f"t{index}"
        out.mkdir()
        config: Any = {"configurable": {"thread_id": f"t{index}"},
                       "recursion_limit": steps * 2 + 10}
        graph.invoke({"step": 0, "out": str(out)}, config, durability="sync")
        starts[str(out)].append(time.perf_counter())

    _wait_go()
    cpu = time.process_time()
    wall = _threads(one, threads)
    ended = time.time()
    cpu = time.process_time() - cpu
    conn.close()
    return {"step_ms": [ms for s in starts.values() for ms in _intervals_ms(s)], "wall_s": wall,
            "steps": steps * threads, "sqlite_synchronous": sync_mode, "journal_mode": journal,
            "ended_at": ended, "cpu_s": cpu,
            "files": sum(len(list(p.iterdir())) for p in directory.glob("t*"))}


# --- DBOS --------------------------------------------------------------------------


def dbos_worker(directory: Path, threads: int, steps: int) -> dict[str, Any]:
    import logging

    import sqlalchemy as sa
    from dbos import DBOS

    seen: dict[str, Any] = {}

    @sa.event.listens_for(sa.engine.Engine, "connect")
    def _durable(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute("PRAGMA synchronous=FULL")
        seen["synchronous"] = dbapi_conn.execute("PRAGMA synchronous").fetchone()[0]
        seen["journal_mode"] = dbapi_conn.execute("PRAGMA journal_mode").fetchone()[0]

    logging.getLogger("dbos").setLevel(logging.WARNING)
    starts: dict[str, list[float]] = {}

    @DBOS.step()
    def write_step(out: str, step: int) -> int:
        starts.setdefault(out, []).append(time.perf_counter())
        _write(Path(out), f"f{step}.txt", step)
        return step

    @DBOS.workflow()
    def agent(out: str) -> int:
        for step in range(steps):
            write_step(out, step)
        return steps

    DBOS(config={"name": "corral-bench",
                 "system_database_url": f"sqlite:///{directory / 'dbos.sqlite'}"})
    DBOS.launch()
    try:
        def one(index: int) -> None:
            out = directory / f"w{index}"
            out.mkdir()
            agent(str(out))
            starts[str(out)].append(time.perf_counter())

        _wait_go()
        cpu = time.process_time()
        wall = _threads(one, threads)
        ended = time.time()
        cpu = time.process_time() - cpu
    finally:
        DBOS.destroy()
    return {"step_ms": [ms for s in starts.values() for ms in _intervals_ms(s)], "wall_s": wall,
            "steps": steps * threads, "sqlite_synchronous": seen.get("synchronous"),
            "journal_mode": seen.get("journal_mode"), "ended_at": ended, "cpu_s": cpu,
            "files": sum(len(list(p.iterdir())) for p in directory.glob("w*"))}


# --- running -------------------------------------------------------------------------


def _threads(target: Any, count: int) -> float:
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # noqa: BLE001  re-raised below, in the worker
            errors.append(exc)

    workers = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    began = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began


def _run_workers(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """Start every worker, let them all prepare, then release them at once;
    the wall time is from the release to the last one's end."""
    procs = [subprocess.Popen([sys.executable, "-m", "ops.bench_step", "--worker", *argv],
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.PIPE) for argv in argvs]
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith(b'{"ready"'):
            proc.kill()
            _, err = proc.communicate()
            raise RuntimeError(f"bench worker failed: {err.decode(errors='replace')[-2000:]}")
    released = time.time()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"bench worker failed: {err.decode(errors='replace')[-2000:]}")
        result = json.loads(out.decode().strip().splitlines()[-1])
        result["wall_s"] = float(result["ended_at"]) - released
        outs.append(result)
    return outs


def _merge(outs: list[dict[str, Any]], agents: int, steps: int) -> dict[str, Any]:
    step_ms = [ms for o in outs for ms in o["step_ms"]]
    files = sum(int(o["files"]) for o in outs)
    if files != agents * steps:
        raise RuntimeError(f"expected {agents * steps} files written, found {files}")
    # processes start together: wall time is the slowest one's
    return {"step_ms": step_ms, "wall_s": max(float(o["wall_s"]) for o in outs),
            "steps": agents * steps, "cpu_s": sum(float(o["cpu_s"]) for o in outs),
            "tree_capture_us": [us for o in outs for us in o.get("tree_capture_us", [])],
            "tree_sync_wait_us": sum(float(o.get("tree_sync_wait_us", 0.0)) for o in outs),
            **{k: v for k, v in outs[0].items() if k in ("sqlite_synchronous", "journal_mode")}}


def run_peer(name: str, threads: int, steps: int) -> dict[str, Any]:
    with temp_state_root() as root:
        out = _run_workers([[name, str(root), str(threads), str(steps)]])[0]
    if int(out["files"]) != threads * steps:
        raise RuntimeError(f"{name}: expected {threads * steps} files, found {out['files']}")
    return out


def _missing(module: str) -> str | None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e '.[bench]')"
    return None


def _one_run(name: str, agents: int, steps: int) -> dict[str, Any]:
    if name.startswith("corral"):
        return run_corral(agents, steps, name)
    return run_peer(name, agents, steps)


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds pooled: every step's time, the steps and wall times added up."""
    return {**runs[0], "step_ms": [ms for r in runs for ms in r["step_ms"]],
            "steps": sum(r["steps"] for r in runs), "wall_s": sum(r["wall_s"] for r in runs),
            "cpu_s": sum(r["cpu_s"] for r in runs),
            "writer_cpu_s": sum(r.get("writer_cpu_s", 0.0) for r in runs),
            "tree_capture_us": [us for r in runs for us in r.get("tree_capture_us", [])],
            "tree_sync_wait_us": sum(r.get("tree_sync_wait_us", 0.0) for r in runs)}


def run(quick: bool = False) -> dict[str, object]:
    steps = 40 if quick else STEPS
    rounds = 2 if quick else ROUNDS
    figures: dict[str, object] = {"steps": steps, "agents_concurrent": AGENTS, "rounds": rounds}
    systems = {"corral": None, "corral_notree": None,
               "langgraph": _missing("langgraph.checkpoint.sqlite"), "dbos": _missing("dbos")}
    for name, skipped in systems.items():
        if skipped is not None:
            figures[f"{name}_skipped"] = skipped
    present = [name for name, skipped in systems.items() if skipped is None]
    # the systems take turns, round after round, so a change in the machine's
    # load falls on all of them alike
    ones: dict[str, list[dict[str, Any]]] = {name: [] for name in present}
    manys: dict[str, list[dict[str, Any]]] = {name: [] for name in present}
    floors: dict[str, list[float]] = {"corral": [], "corral_notree": [], "langgraph": []}
    creates: list[float] = []  # what a file create costs in the runs' directory, a round
    for _ in range(rounds):
        for name in present:
            ones[name].append(_one_run(name, 1, steps))
        with temp_state_root() as root:
            creates.append(file_create_us(root))
            for name, times in sync_floor_ms(root, FLOOR_ROUNDS).items():
                floors[name].extend(times)
        for name in present:
            manys[name].append(_one_run(name, AGENTS, steps))
    # what the disk alone makes a step cost (no CPU work): four syncs in a corral
    # step (three without the tree), three under a LangGraph super-step; same
    # disk, same run
    for name, times in floors.items():
        figures[f"{name}_sync_floor_ms_p50"] = round(percentile(times, 50), 2)
    # every system's step creates a temp file: a slow create adds the same to
    # each, and narrows their ratios (docs/performance.md, "Running them")
    figures["file_create_us"] = round(percentile(creates, 50), 1)
    for name in present:
        one, many = _pooled(ones[name]), _pooled(manys[name])
        figures[f"{name}_step_ms_p50"] = round(percentile(one["step_ms"], 50), 2)
        figures[f"{name}_step_ms_p99"] = round(percentile(one["step_ms"], 99), 2)
        figures[f"{name}_steps_per_s_1"] = round(one["steps"] / one["wall_s"], 1)
        figures[f"{name}_steps_per_s_8"] = round(many["steps"] / many["wall_s"], 1)
        figures[f"{name}_step_ms_p50_8"] = round(percentile(many["step_ms"], 50), 2)
        # CPU a step costs (all of the runtime's processes), and the rate that
        # would use both cores of this machine entirely: an upper bound for 8 at once
        cpu_s = (float(many["cpu_s"]) + float(many["writer_cpu_s"])) / many["steps"]
        figures[f"{name}_cpu_ms_per_step_8"] = round(cpu_s * 1000, 2)
        figures[f"{name}_cpu_bound_steps_per_s_2_cores"] = round(2 / cpu_s, 1)
        if "sqlite_synchronous" in one:
            figures[f"{name}_sqlite"] = {"synchronous": one["sqlite_synchronous"],
                                         "journal_mode": one["journal_mode"]}
    if "corral_notree_step_ms_p50" in figures:  # what the workspace tree costs a step
        figures["corral_tree_ms_per_step_p50"] = round(
            float(figures["corral_step_ms_p50"])  # type: ignore[arg-type]
            - float(figures["corral_notree_step_ms_p50"]), 2)  # type: ignore[arg-type]
    if "corral" in present:  # of which: the capture's CPU, the wait for the pack's sync
        lone = _pooled(ones["corral"])
        if lone["tree_capture_us"]:
            figures["corral_tree_capture_cpu_us_p50"] = round(
                percentile(lone["tree_capture_us"], 50), 1)
        figures["corral_tree_sync_wait_us_per_step"] = round(
            float(lone["tree_sync_wait_us"]) / lone["steps"], 1)
    peers = [float(v) for k, v in figures.items()  # type: ignore[arg-type]
             if k in ("langgraph_step_ms_p50", "dbos_step_ms_p50")]
    rates = [float(v) for k, v in figures.items()  # type: ignore[arg-type]
             if k in ("langgraph_steps_per_s_8", "dbos_steps_per_s_8")]
    if peers:
        best = min(peers)
        figures["corral_over_best_peer_step_ms"] = round(
            float(figures["corral_step_ms_p50"]) / best, 2)  # type: ignore[arg-type]
        figures["corral_over_best_peer_steps_per_s_8"] = round(
            float(figures["corral_steps_per_s_8"]) / max(rates), 2)  # type: ignore[arg-type]
        # the CPU a step (all processes) at which two cores could run 2x the
        # better peer's rate at all: against corral_cpu_ms_per_step_8
        figures["cpu_ms_per_step_for_2x_on_2_cores"] = round(1000 / max(rates), 2)
        figures["targets"] = {
            "corral_step_ms_p50<=best_peer": float(figures["corral_step_ms_p50"])  # type: ignore[arg-type]
            <= best,
            "corral_steps_per_s_8>=2x_best_peer": float(figures["corral_steps_per_s_8"])  # type: ignore[arg-type]
            >= 2 * max(rates),
        }
    return figures


def _worker(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["corral", "corral_notree", "langgraph", "dbos"])
    parser.add_argument("args", nargs="*")
    args = parser.parse_args(argv)
    if args.system.startswith("corral"):
        root, agent, steps = args.args
        return corral_worker(Path(root), agent, int(steps), trees=args.system == "corral")
    directory, threads, steps = args.args
    fn = langgraph_worker if args.system == "langgraph" else dbos_worker
    return fn(Path(directory), int(threads), int(steps))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2:])))
        sys.exit(0)
    sys.exit("run it as: python ops/bench.py step [--json] [--quick]")
