"""`host_failover_ms` for `bench.py fleet` (docs/fleet.md, "Adoption"): two
corral hosts (`supervisor up` in fleet mode, each its own state directory) on
a running local cluster; an agent of host A waits for an approval; host A's
supervisor is SIGKILLed (its children die with it) and the clock runs until
the agent's first record appended on host B (its resumed `session_start`).
The figure is dominated by detection: `host_ttl_s + dead_grace_s` plus up to a
status round; the settings used are reported with it. "Resumed" is the
adopted agent's `state_rebuilt` on host B (its state folded from the adopted
records, before its next turn).

The agent has a history first (`steps` file writes, ~7 records each; the
default `snapshot_every` 256 makes a generation every 256 events), so the
adopter restores its newest uploaded generation (supervisor/fleet/generations.py) and
the agent folds only the tail: `failover_rebuild_generation_seq` (0: folded
from the first record), `failover_rebuild_tail_events`, `failover_rebuild_ms`
(the agent's own figure), against `failover_full_fold_ms`, the same state
rebuilt on host B from the first record, measured in the same run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ops.benchkit import child_env

HOST_TTL_S = 4.0
DEAD_GRACE_S = 1.0
def _task(steps: int) -> list[dict[str, str]]:
    return [*({"op": "write_file", "path": f"f/{k}.txt", "content": f"{k}\n"}
              for k in range(steps)),
            {"op": "write_file", "path": "release/n.md", "content": "v1"},  # asks: it waits
            {"op": "finish", "summary": "done"}]


def _config(root: Path, host: str, urls: list[str]) -> Path:
    fast = {"backoff": {"base_s": 0.05, "cap_s": 0.2, "jitter": 0.0}}
    config = {
        "heartbeat": {"interval_ms": 200, "timeout_s": 5}, "status_interval_s": 0.3,
        "children": [{"name": "writer", "kind": "writer", "fatal_exit_codes": [65, 77, 78],
                      **fast},
                     {"name": "broker", "kind": "broker", **fast}],
        "agents": {"count": 0},
        "agent": {"approval_poll_ms": 20, "permissions": {"rules": [
            {"op": "write_file", "path": "release/*", "decision": "ask"}]}},
        "fleet": {"host": host, "urls": urls, "host_ttl_s": HOST_TTL_S,
                  "dead_grace_s": DEAD_GRACE_S},
    }
    path = root / f"{host}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--state-dir",
                           str(state)], env=child_env(), capture_output=True, text=True,
                          timeout=30, check=False)


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _starts(state: Path, agent: str) -> int:
    """How many `session_start` records the agent has in this host's WAL."""
    import zmq

    from actors.writer.client import WriterClient
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, StateDir.at(state), "bench-probe", timeout_s=1,
                          retries=0) as writer:
            return sum(1 for r in writer.read_stream(f"agent/{agent}")
                       if r.event == "session_start")
    except Exception:  # noqa: BLE001 - the writer not up yet
        return 0
    finally:
        ctx.destroy(linger=0)


def _hosts_up(state: Path, hosts: set[str]) -> bool:
    import json

    if not (state / "run" / "fleet.json").exists():
        return False
    done = _cli(state, "status", "--fleet", "--json")
    if done.returncode != 0:
        return False
    seen = {h["host"] for h in json.loads(done.stdout)["hosts"]
            if not h["stale"] and h["children"]}
    return hosts <= seen


def _generations_up(state: Path, urls: list[str], host: str, agent: str) -> bool:
    """Every generation file of the agent is in the object store (True at once
    with a corral that does not upload them: the figures then say so)."""
    try:
        from supervisor.fleet.generations import uploaded_generations
    except ImportError:
        return True
    made = sorted(int(p.name[4:24]) for p in
                  (state / "agents" / agent / "state" / "generations").glob("gen-*.json"))
    return uploaded_generations(urls, host, agent) == made


def _pending(state: Path, agent: str) -> bool:
    import zmq

    from actors.sessions.rebuild import rebuild
    from actors.writer.client import WriterClient
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, StateDir.at(state), "bench-probe", timeout_s=2,
                          retries=0) as writer:
            return bool(rebuild(writer, StateDir.at(state), agent).state.pending_approvals())
    except Exception:  # noqa: BLE001 - the writer not up yet
        return False
    finally:
        ctx.destroy(linger=0)


def _full_fold_ms(state: Path, agent: str) -> tuple[float, float]:
    """(ms, events) of the agent's state rebuilt from its first record on this host."""
    import zmq

    from actors.sessions.rebuild import rebuild
    from actors.writer.client import WriterClient
    from broker.statedir import StateDir

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with WriterClient(ctx, StateDir.at(state), "bench-probe") as writer:
            runs = [rebuild(writer, StateDir.at(state), agent, use_generations=False)
                    for _ in range(3)]
            return sorted(r.elapsed_ms for r in runs)[1], float(runs[0].tail_events)
    finally:
        ctx.destroy(linger=0)


def host_failover_ms(root: Path, urls: list[str], steps: int = 120) -> dict[str, float]:
    import json

    from supervisor.fleet.adopt import uploaded_pack_size

    tag = str(int(time.time() * 1000) % 10**8)
    ha, hb = f"fa{tag}", f"fb{tag}"
    state_a, state_b = root / "fa" / ".corral", root / "fb" / ".corral"
    for state in (state_a, state_b):
        state.mkdir(parents=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for state, host in ((state_a, ha), (state_b, hb)):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(state),
                 "--config", str(_config(root, host, urls))], env=child_env(),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        _wait(lambda: _hosts_up(state_a, {ha, hb}), 60, "both hosts in the fleet view")
        task = root / "task.yaml"
        task.write_text(yaml.safe_dump({"name": "failover", "steps": _task(steps)}))
        done = _cli(state_a, "spawn", "victim", "--task", str(task), "--json")
        if done.returncode != 0:
            raise RuntimeError(done.stdout + done.stderr)
        _wait(lambda: _pending(state_a, "victim"), 120, "the agent on host A waiting")
        pack = state_a / "trees" / "packs" / "victim.pack"
        _wait(lambda: pack.exists()
              and uploaded_pack_size(urls, ha, "victim") == pack.stat().st_size
              and _generations_up(state_a, urls, ha, "victim"),
              30, "the agent's bundle in the object store")
        killed = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        log = state_b / "logs" / "victim.log"
        _wait(lambda: log.exists() and b'"state_rebuilt"' in log.read_bytes(), 60,
              "the agent resumed on host B")
        failover_ms = (time.monotonic() - killed) * 1000
        rebuilt = next(r for line in log.read_bytes().splitlines()
                       if (r := json.loads(line)).get("event") == "state_rebuilt")
        _wait(lambda: _pending(state_b, "victim"), 60, "the agent on host B waiting")
        full_ms, events = _full_fold_ms(state_b, "victim")
        return {"host_failover_ms": failover_ms,
                "failover_host_ttl_s": HOST_TTL_S, "failover_dead_grace_s": DEAD_GRACE_S,
                "failover_agent_events": events,
                "failover_rebuild_generation_seq": float(rebuilt["generation_seq"]),
                "failover_rebuild_tail_events": float(rebuilt["tail_events"]),
                "failover_rebuild_ms": float(rebuilt["elapsed_ms"]),
                "failover_full_fold_ms": full_ms}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
