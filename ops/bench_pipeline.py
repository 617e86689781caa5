"""`python ops/bench.py pipeline --json`: a pipeline step against an agent op.

One real writer process (real fsync), and in the same run, interleaved in
rounds so both see the same machine: the agent loop with the scripted model
doing N `write_file` ops (one model call, i.e. one `turn`, per op), and a
pipeline runner (the same loop with the pipeline backend) doing a pipeline
of N `write_file` steps. Both loops run in this process with a WriterClient
to the writer, exactly as an agent process runs them. An op's / a step's
time is the time from the previous `tool_result` to its own (everything the
loop does for it: the turn when there is one, tool_call, permission,
tool_start, the write, tool_result). Target: step_ms_p50 <= agent_op_ms_p50.
Where a step saves: independent steps ride in one `turn` (a batch of up to
16), where the agent records a model turn for each op; and a step's result
that no later step reads is made durable with the next step's facts rather
than by an fdatasync of its own (docs/pipelines.md).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import structlog
import yaml

from actors.agent.loop import AgentLoop, Step
from actors.kernel.settings import AgentSettings, AgentSpec
from actors.pipelines import runfile
from broker.statedir import StateDir
from ops.benchkit import percentile, start_writer, stop, temp_state_root, wait_writer_ready


def _timed(loop: AgentLoop) -> list[float]:
    """Run the loop to its end; the ms between consecutive tool_results."""
    loop.rebuild()
    marks: list[float] = []
    seen = loop.state.counts.tool_results
    last = time.perf_counter()
    while True:
        step = loop.step()
        now = time.perf_counter()
        if loop.state.counts.tool_results != seen:
            seen = loop.state.counts.tool_results
            marks.append((now - last) * 1000)
            last = now
        if step is not Step.PROGRESS:
            break
    assert loop.state.phase == "finished", loop.state.phase
    return marks[:-1]  # the last result is `finish`


def _agent(state_dir: StateDir, root: Path, name: str, count: int, writer: object) -> list[float]:
    task = root / f"{name}.yaml"
    steps = [{"op": "write_file", "path": f"out/{i}.txt", "content": f"line {i}\n"}
             for i in range(count)]
    task.write_text(yaml.safe_dump({"name": name, "setup": steps}))
    spec = AgentSpec(task=str(task), settings=AgentSettings(max_turns=count + 10))
    return _timed(AgentLoop(name, state_dir, spec, writer))  # type: ignore[arg-type]


def _pipeline(state_dir: StateDir, name: str, count: int, writer: object) -> list[float]:
    text = yaml.safe_dump({"name": "bench", "steps": [
        {"id": f"w{i}", "op": "write_file",
         "args": {"path": f"out/{i}.txt", "content": f"line {i}\n"}} for i in range(count)]})
    path = runfile.write(state_dir, name, runfile.RunFile(pipeline="bench", source="bench",
                                                          text=text))
    spec = AgentSpec(task=str(path), backend="pipeline",
                     settings=runfile.runner_settings(AgentSettings()))
    return _timed(AgentLoop(name, state_dir, spec, writer))  # type: ignore[arg-type]


def run(quick: bool = False) -> dict[str, object]:
    import zmq

    from actors.writer.client import WriterClient

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    total = 100 if quick else 1000
    rounds = 4
    per_round = total // rounds
    agent_ms: list[float] = []
    step_ms: list[float] = []
    with temp_state_root() as root:
        state_dir = StateDir(root / ".corral").ensure()
        writer_proc = start_writer(state_dir.root)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            wait_writer_ready(state_dir.root)
            for r in range(rounds):  # interleaved: both see the same machine
                # one client per loop, its origin its name, as in an agent process
                # (idempotency keys are per origin)
                with WriterClient(ctx, state_dir, f"agent-{r}", timeout_s=30) as writer:
                    agent_ms += _agent(state_dir, root, f"agent-{r}", per_round, writer)
                with WriterClient(ctx, state_dir, f"pipe-{r}", timeout_s=30) as writer:
                    step_ms += _pipeline(state_dir, f"pipe-{r}", per_round, writer)
        finally:
            ctx.destroy(linger=0)
            stop(writer_proc)
    agent_p50, step_p50 = percentile(agent_ms, 50), percentile(step_ms, 50)
    return {
        "ops": len(agent_ms), "steps": len(step_ms), "rounds": rounds,
        "agent_op_ms_p50": round(agent_p50, 3), "step_ms_p50": round(step_p50, 3),
        "agent_op_ms_p99": round(percentile(agent_ms, 99), 3),
        "step_ms_p99": round(percentile(step_ms, 99), 3),
        "agent_op_ms_mean": round(statistics.fmean(agent_ms), 3),
        "step_ms_mean": round(statistics.fmean(step_ms), 3),
        "step_over_agent_p50": round(step_p50 / agent_p50, 3),
        "target_met": step_p50 <= agent_p50,
    }
