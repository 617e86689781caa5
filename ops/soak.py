"""The soak test: the real runtime under load and random SIGKILLs, then checks.

    python ops/soak.py --duration S --agents N --kill-interval-ms I [--seed X] [--json]
    python ops/soak.py --hosts 3 --kill-host-interval-ms I [--writers-only] ...

Prints one JSON object; exits 1 on any violation, 2 when the run itself
failed. See docs/soak.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from broker.lifeline import die_with_parent
from broker.statedir import StateDir
from ops import soakcheck
from ops.soakruntime import (
    MARKER_ENV,
    Approver,
    Control,
    CutBudget,
    Run,
    kill_group,
    kill_loop,
    orphans,
    wait_agents_finished,
    wait_runtime_up,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _env(marker: str | None, journal: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if marker is not None:
        env[MARKER_ENV] = marker
    if journal is not None:
        env["CORRAL_ACK_JOURNAL_DIR"] = str(journal)
    return env


def write_config(root: Path, agents: int) -> Path:
    """The default configuration, with N agents on the soak task and restart
    intensities that tolerate a kill every few hundred milliseconds."""
    data = yaml.safe_load((REPO_ROOT / "config" / "default.yaml").read_text())
    storm = {"max_restarts": 100_000, "period_s": 60}
    quick = {"base_s": 0.05, "cap_s": 0.5, "jitter": 0.2}
    for child in data["children"]:
        if child.get("enabled", True) is False and child["kind"] in ("procs", "subagents"):
            module = REPO_ROOT / "actors" / child["kind"]
            child["enabled"] = module.is_dir() and (module / "__main__.py").exists()
        child["intensity"] = storm
        child["backoff"] = quick
    data["agents"].update(count=agents, restart="transient", intensity=storm, backoff=quick)
    path = root / "soak.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# typed into a terminal that does not echo it: the WAL may hold only its hash
TERMINAL_SECRET = "soak-secret-7f3c9a"
CHILD_FILE = "child/made.txt"
CHILD_CONTENT = "made by a subagent\n"
CHILD_TASK_FILE = "soak-child.yaml"


def child_task_text() -> str:
    """The subagent's task, written into the parent's workspace by the task."""
    child = {
        "name": "soak-child",
        "steps": [
            {"op": "write_file", "path": CHILD_FILE, "content": CHILD_CONTENT},
            {"op": "bash", "command": "echo child-ran"},
        ],
    }
    text: str = yaml.safe_dump(child, sort_keys=False)
    return text


def write_task(root: Path, repeat: int) -> Path:
    """The soak task: every op the runtime has (files, memory, todos, an
    approval, a background command, a subagent whose change set is applied
    once and refused the second time, a terminal typed a secret into), with
    a loop of `repeat` passes."""
    task = {
        "name": "soak",
        "prompt": "Keep a log, write work items, remember progress, delegate once.",
        "repeat": repeat,
        "setup": [
            {"op": "write_file", "path": "log.txt", "content": "log\nend\n"},
            {"op": "write_file", "path": "release/plan.md", "content": "plan\n"},  # asks
            {"op": "todos", "items": [{"text": "work", "done": False}]},
            # the child's task goes in the workspace: a task file elsewhere is refused
            {"op": "write_file", "path": CHILD_TASK_FILE, "content": child_task_text()},
            {"op": "spawn_subagent", "task": CHILD_TASK_FILE, "descriptor": "helper"},
            {"op": "subagent_changes", "subagent_id": "latest"},
            {"op": "apply_subagent", "subagent_id": "latest"},
            {"op": "apply_subagent", "subagent_id": "latest"},  # refused: applied once only
            {"op": "terminal_start", "command": "stty -echo; read -r line; echo got ${#line}"},
            {"op": "terminal_input", "proc_id": "{last_terminal}",
             "text": TERMINAL_SECRET + "\n"},
            {"op": "terminal_read", "proc_id": "{last_terminal}"},
            {"op": "terminal_end", "proc_id": "{last_terminal}"},
        ],
        "steps": [
            {"op": "edit_file", "path": "log.txt", "old": "end", "new": "pass {i}\nend"},
            {"op": "write_file", "path": "work/{i}.txt", "content": "item {i}\n"},
            {"op": "bash", "command": "echo pass {i}"},
            {"op": "memory_write", "key": "progress", "content": "at pass {i}"},
            {"op": "memory_read", "key": "progress"},
            {"op": "read_file", "path": "log.txt"},
            {"op": "search", "text": "pass {i}"},
            {"op": "list_dir", "path": "work"},
            {"op": "edit_file", "path": "log.txt"},  # malformed: a schema_reject each pass
        ],
    }
    path = root / "soak-task.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def write_specs(state_dir: StateDir, config: Path, agents: int, prefix: str, task: Path) -> None:
    """Each agent plays the soak task under the configuration's agent settings
    (so `release/*` writes ask for an approval), with a turn bound above the
    task's length: the soak checks that agents finish the task, not that they
    hit a bound."""
    from actors.kernel.settings import AgentSettings, AgentSpec, Budget, load_task, write_spec

    settings = AgentSettings.model_validate(yaml.safe_load(config.read_text()).get("agent", {}))
    plan = load_task(task)
    turns = len(plan.setup) + len(plan.steps) * plan.repeat + 1  # + finish
    settings = settings.model_copy(
        update={"max_turns": max(settings.max_turns, 2 * turns), "budget": Budget()}
    )
    for i in range(1, agents + 1):
        write_spec(state_dir, f"{prefix}{i}", AgentSpec(task=str(task), settings=settings))


def stop_supervisor(state_dir: StateDir, supervisor: subprocess.Popen[bytes]) -> int | None:
    subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "stop", "--state-dir", str(state_dir.root)],
        capture_output=True,
        timeout=300,
        check=False,
        env=_env(None),
        cwd=REPO_ROOT,
    )
    try:
        return supervisor.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_group(supervisor.pid)
        supervisor.wait()
        return None


def soak(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="corral-soak-", dir="/tmp"))
    state_dir = StateDir(root / ".corral").ensure()
    journal = root / "journal"
    marker = uuid.uuid4().hex
    config = write_config(root, args.agents)
    write_specs(state_dir, config, args.agents, "agent-", write_task(root, args.task_repeat))
    run = Run(started_at=time.time())
    out = open(root / "supervisor.out", "wb")  # noqa: SIM115 - handed to the child
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "up",
            "--state-dir",
            str(state_dir.root),
            "--config",
            str(config),
        ],
        env=_env(marker, journal),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # if the soak itself is killed, its runtime goes too (and, by the
        # supervisor's own PDEATHSIG, every child of it)
        preexec_fn=partial(die_with_parent, os.getpid()),  # noqa: PLW1509 - no thread yet
    )
    out.close()
    figures: dict[str, object] = {}
    control = Control(state_dir)
    approver = Approver(state_dir, control)
    try:
        wait_runtime_up(control, supervisor, str(root / "supervisor.out"))
        names = {f"agent-{i}" for i in range(1, args.agents + 1)}
        kill_loop(
            state_dir,
            control,
            approver,
            supervisor,
            run,
            rng,
            args.duration,
            args.kill_interval_ms / 1000,
            args.cut_chance,
            # at least half the agents keep every acknowledged fact: the
            # agent-level checks (their files, their turns) run on those
            CutBudget(frozenset(names), args.agents // 2),
        )
        # Agents whose acknowledged facts a cut destroyed: their files and
        # answers are ahead of their WAL stream, so the agent-level invariants
        # cannot be asked of them (the WAL-level ones still are).
        tainted = soakcheck.cut_victims(journal, [c.__dict__ for c in run.cuts]) & names
        checked = names - tainted
        finished = wait_agents_finished(control, approver, checked, args.finish_timeout)
        exit_code = stop_supervisor(state_dir, supervisor)
        left = orphans(marker)
        figures = soakcheck.check(
            state_dir, journal, [c.__dict__ for c in run.cuts], args.task_repeat, tainted
        )
        figures.update(
            agents=args.agents,
            agents_checked=len(checked),
            agents_tainted_by_cuts=sorted(tainted),
            agents_finished=finished,
            supervisor_exit=exit_code,
            orphans=len(left),
            orphan_list=left[:20],
        )
    finally:
        approver.close()
        control.close()
        if supervisor.poll() is None:
            kill_group(supervisor.pid)
            supervisor.wait()
        orphans(marker)
    total = sum(run.kills.values())
    figures.update(
        duration_s=args.duration,
        kill_interval_ms=args.kill_interval_ms,
        seed=args.seed,
        kills={"total": total, **run.kills},
        cuts=len(run.cuts),
        approvals_answered=approver.answered,
        peak_rss_mib=run.peak_rss_mib,
        status_failures=run.status_failures,
        state_dir=str(state_dir.root),
    )
    if args.keep:
        figures["kept"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return figures


def violations(figures: dict[str, object]) -> list[str]:
    bad = []
    for key in (
        "lost",
        "duplicates",
        "checksum_failures",
        "orphans",
        "state_mismatches",
        "workspace_mismatches",
        "double_applies",
        "commands_started_twice",
        "secrets_in_wal",
    ):
        if figures.get(key):
            bad.append(f"{key}={figures[key]}")
    if figures.get("gapless") is not True:
        bad.append("gapless=false")
    if figures.get("agents_finished") != figures.get("agents_checked"):
        bad.append(
            f"agents_finished={figures.get('agents_finished')} of {figures.get('agents_checked')}"
        )
    if figures.get("supervisor_exit") != 0:
        bad.append(f"supervisor_exit={figures.get('supervisor_exit')}")
    return bad


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--hosts" in argv and "--writers-only" in argv:  # writers only (ops/soak_fleet.py)
        from ops import soak_fleet

        return soak_fleet.main([a for a in argv if a != "--writers-only"])
    if "--hosts" in argv:  # real hosts, host kills, adoption (ops/soak_hosts.py, docs/fleet.md)
        from ops import soak_hosts

        return soak_hosts.main(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, required=True, help="seconds of killing")
    parser.add_argument("--agents", type=int, required=True)
    parser.add_argument("--kill-interval-ms", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cut-chance",
        type=float,
        default=0.1,
        help="share of writer kills that also cut the WAL tail",
    )
    parser.add_argument(
        "--finish-timeout",
        type=float,
        default=600,
        help="seconds to let agents finish after the killing stops",
    )
    parser.add_argument(
        "--task-repeat", type=int, default=20, help="passes of the soak task's loop per agent"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    args = parser.parse_args(argv)
    try:
        figures = soak(args)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    bad = violations(figures)
    figures["violations"] = bad
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    else:
        for key, value in sorted(figures.items()):
            print(f"{key:24} {value}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
