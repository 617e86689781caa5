"""The fleet soak with real hosts: whole-host kills, fencing, adoption.

One host is down at a time. See docs/soak.md ("The fleet soak with real
hosts").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import yaml

from broker.lifeline import die_with_parent
from broker.statedir import StateDir
from ops.soakruntime import MARKER_ENV, Control, orphans

REPO_ROOT = Path(__file__).resolve().parent.parent
FAST = {"backoff": {"base_s": 0.05, "cap_s": 0.2, "jitter": 0.0},
        "intensity": {"max_restarts": 1000, "period_s": 30}, "shutdown_timeout_s": 3}
HOST_TTL_S = 5.0
DEAD_GRACE_S = 1.0
MIN_ACKED = 20  # a host's agents' acknowledged appends before it may be killed
ADOPT_DELAY_S = 0.0  # --adopt-delay-s: each agent's adoption made this slow (a fault)
FENCED_EXIT = 69  # a supervisor whose writer met the fence gives up (docs/fleet.md)


@dataclass
class Host:
    name: str
    slot: int  # its NATS node: the cluster's node slot + 1
    state_dir: StateDir
    config: Path
    journal: Path  # its clients' ack journals (CORRAL_ACK_JOURNAL_DIR)
    marker: str  # CORRAL_SOAK_ID of every process of this incarnation
    agents: list[str] = field(default_factory=list)  # spawned here (adopted ones aside)
    proc: subprocess.Popen[bytes] | None = None
    alive: bool = False
    dead: bool = False  # declared dead (fenced) by the fleet
    fenced_by: str = ""
    fenced_restart_exit: int | None = None


@dataclass
class Soak:
    root: Path
    urls: list[str]
    public_key: Path
    bus_secret: Path
    repeat: int
    rng: random.Random
    hosts: list[Host] = field(default_factory=list)
    kills: int = 0
    node_kills: int = 0
    live_hosts_expired: list[str] = field(default_factory=list)
    fencer_kills: int = 0  # a fencer killed the moment it fenced, before its adoption
    unplanned_deaths: list[str] = field(default_factory=list)  # fenced while running
    failover_ms: list[float] = field(default_factory=list)  # kill -> member adopted
    adopted: dict[str, list[str]] = field(default_factory=dict)  # dead host -> agents
    not_adopted: dict[str, list[str]] = field(default_factory=dict)
    fenced_restarts: list[dict[str, Any]] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    node_down: int | None = None


def task_text(agent: str, repeat: int) -> str:
    """The agent's scripted task: a file shared by every agent (its objects land
    in one agent's pack: the others' bundles need their extras), a log edited
    every pass, a work item per pass (its own content)."""
    return str(yaml.safe_dump({
        "name": f"soak-{agent}",
        "prompt": "Keep a log and write work items.",
        "repeat": repeat,
        "setup": [
            {"op": "write_file", "path": "common.txt", "content": "shared by every agent\n"},
            {"op": "write_file", "path": "log.txt", "content": "log\nend\n"},
        ],
        "steps": [
            {"op": "write_file", "path": "work/{i}.txt", "content": f"item {{i}} of {agent}\n"},
            {"op": "edit_file", "path": "log.txt", "old": "end", "new": "pass {i}\nend"},
        ],
    }, sort_keys=False))


def expected_workspace(agent: str, repeat: int) -> dict[str, str]:
    """What the task leaves when each op is applied exactly once."""
    files = {"common.txt": "shared by every agent\n",
             "log.txt": "log\n" + "".join(f"pass {i}\n" for i in range(repeat)) + "end\n"}
    files.update({f"work/{i}.txt": f"item {i} of {agent}\n" for i in range(repeat)})
    return files


def workspace(state_dir: StateDir, agent: str) -> dict[str, str]:
    root = state_dir.agent_dir(agent) / "workspace"
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): p.read_text(errors="replace")
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".corral-tmp")}


def _env(host: Host) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env[MARKER_ENV] = host.marker
    env["CORRAL_ACK_JOURNAL_DIR"] = str(host.journal)
    env.pop("CORRAL_OPERATOR_KEY", None)
    if ADOPT_DELAY_S:  # the injected fault of --adopt-delay-s
        env["CORRAL_FAULT_ADOPT_DELAY_S"] = str(ADOPT_DELAY_S)
    return env


def new_host(soak: Soak, name: str, slot: int) -> Host:
    base = soak.root / name
    state_dir = StateDir(base / ".corral").ensure()
    config = {
        "heartbeat": {"interval_ms": 200, "timeout_s": 5},
        "status_interval_s": 0.5,
        "broker": {"heartbeat_interval_ms": 200, "heartbeat_misses": 5},
        "children": [
            {"name": "writer", "kind": "writer", "fatal_exit_codes": [65, 77, 78], **FAST},
            {"name": "broker", "kind": "broker", **FAST},
        ],
        "agents": {"count": 0, "restart": "transient", **FAST},
        "agent": {"snapshot_every": 16, "max_turns": 4 * soak.repeat + 50},
        "fleet": {"host": name, "urls": [soak.urls[slot - 1]],
                  "operator_public_key": str(soak.public_key),
                  "bus_secret": str(soak.bus_secret),
                  "host_ttl_s": HOST_TTL_S, "dead_grace_s": DEAD_GRACE_S},
    }
    path = base / "corral-fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    return Host(name, slot, state_dir, path, base / "journal", uuid.uuid4().hex)


def start(host: Host) -> None:
    out = open(host.state_dir.root.parent / "supervisor.out", "ab")  # noqa: SIM115 - the child's
    host.proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(host.state_dir.root),
         "--config", str(host.config)],
        env=_env(host), cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out,
        stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=partial(die_with_parent, os.getpid()))  # noqa: PLW1509 - no thread yet
    out.close()
    host.alive = True


async def _connect(urls: list[str]) -> Any:
    import nats

    async def quiet(_exc: Exception) -> None:
        return None

    return await nats.connect(urls, connect_timeout=2, error_cb=quiet)


def fleet_entries(urls: list[str]) -> tuple[set[str] | None, dict[str, dict[str, Any]]]:
    """(hosts whose status entry is live, members: name -> entry); (None, {}) when
    the read failed."""
    from supervisor.fleet.host import BUCKET
    from supervisor.fleet.natsclient import kv_entries
    from supervisor.fleet.watch import MEMBERS

    async def go() -> tuple[set[str], dict[str, dict[str, Any]]]:
        nc = await _connect(urls)
        try:
            js = nc.jetstream(timeout=5)
            live = set(await kv_entries(js, BUCKET))
            entries = await kv_entries(js, MEMBERS)
            members = {k: json.loads(v or b"{}") for k, v in entries.items()}
            return live, members
        finally:
            await nc.close()

    try:
        return asyncio.run(go())
    except Exception:  # noqa: BLE001 - a read under load or an election: try again
        return None, {}


def stream_last(urls: list[str], host: str) -> int:
    from supervisor.fleet.replicate import stream_name

    async def go() -> int:
        nc = await _connect(urls)
        try:
            info = await nc.jetstream(timeout=5).stream_info(stream_name(host))
            return int(info.state.last_seq)
        finally:
            await nc.close()

    return asyncio.run(go())


def uploaded_specs(urls: list[str]) -> set[str]:
    """`host/agent` of every agent bundle's spec in the object store."""
    from supervisor.fleet.adopt import OBJECTS

    async def go() -> set[str]:
        nc = await _connect(urls)
        try:
            bucket = await nc.jetstream(timeout=5).object_store(OBJECTS)
            return {i.name.removesuffix("/spec") for i in await bucket.list()
                    if i.name.endswith("/spec") and i.name.count("/") == 2}
        finally:
            await nc.close()

    try:
        return asyncio.run(go())
    except Exception:  # noqa: BLE001 - no bucket yet, or a read under load: not yet
        return set()


def wait_bundles(soak: Soak, timeout_s: float = 60) -> None:
    """Until every agent of every live host has its bundle in the object store,
    and every host's agents have made some acknowledged progress. An agent
    killed before its host's first upload of it cannot be adopted (a
    documented limit, docs/fleet.md "What a host loss costs"), and one killed
    before its first step adopts nothing: the soak kills after both, so that
    every kill soaks the adoption of work."""
    def up() -> bool:
        want = {f"{h.name}/{a}" for h in soak.hosts if h.alive
                for a in _spec_names(h.state_dir)}
        return all(acked(h) >= MIN_ACKED for h in soak.hosts if h.alive and h.agents) \
            and want <= uploaded_specs(soak.urls)

    wait(up, timeout_s, "every agent's bundle uploaded, every host at work", 0.5)


def acked(host: Host) -> int:
    """Appends acknowledged to the host's agents so far (their ack journals)."""
    total = 0
    for agent in host.agents:
        path = host.journal / f"{agent}.acks"
        with contextlib.suppress(OSError):
            total += path.read_bytes().count(b"\n")
    return total


def wait(condition: Any, timeout_s: float, what: str, interval_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g}s: {what}")
        time.sleep(interval_s)


def wait_up(soak: Soak, host: Host, timeout_s: float = 90) -> None:
    """Until its writer and broker run and it is in the fleet's status bucket."""
    control = Control(host.state_dir)
    try:
        def up() -> bool:
            if host.proc is not None and host.proc.poll() is not None:
                raise RuntimeError(f"host {host.name} exited {host.proc.returncode} at start")
            children = control.children(timeout_s=0.5)
            if not children or not all(c.state == "running" for c in children
                                       if c.kind != "agent"):
                return False
            return host.name in (fleet_entries(soak.urls)[0] or set())

        wait(up, timeout_s, f"host {host.name} up")
    finally:
        control.close()


def spawn_agents(soak: Soak, host: Host, count: int) -> None:
    from supervisor.fleet import ctl

    for i in range(1, count + 1):
        name = f"{host.name}-a{i}"
        reply = ctl.carry_out(host.state_dir, {
            "verb": "spawn", "agent": name, "task": task_text(name, soak.repeat),
            "model": None})
        if not reply.get("ok"):
            raise RuntimeError(f"spawn {name} on {host.name}: {reply}")
        host.agents.append(name)


def _tree_pids(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and \
                    proc.environ().get(MARKER_ENV) == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def kill_host(soak: Soak, host: Host) -> None:
    """SIGKILL the host's supervisor and every process under it at once (the
    machine gone), then make sure nothing of it survives."""
    assert host.proc is not None
    victims = _tree_pids(host.proc.pid)
    for proc in victims:
        try:
            proc.kill()
        except psutil.Error:
            continue
    host.proc.wait(10)
    host.alive = False
    soak.kills += 1
    try:  # anything started between the listing and the kill dies by PDEATHSIG
        wait(lambda: not marked(host.marker), 15, f"host {host.name}'s processes gone", 0.1)
    except RuntimeError:
        soak.leaked += orphans(host.marker)


def wait_adopted(soak: Soak, host: Host, killed_at: float | None,
                 timeout_s: float = 150) -> None:
    def adopted() -> dict[str, Any] | None:
        live, members = fleet_entries(soak.urls)
        entry = members.get(host.name, {})
        if live is not None and entry.get("dead"):  # fenced, being adopted (a read
            # that failed judges nobody; before the fence a NATS node killed with the
            # victim may hold the status bucket's leader: puts wait for the election)
            for other in soak.hosts:  # a running host must not go silent, even the
                # one adopting (its status entry expired: the fleet would fence it)
                if other.alive and other.name not in live and other.proc is not None \
                        and other.proc.poll() is None:
                    soak.live_hosts_expired.append(f"{other.name} while {host.name} "
                                                   "was being adopted")
        return entry if entry.get("dead") and "adopted_at" in entry else None

    entry = wait(adopted, timeout_s, f"host {host.name} declared dead and adopted", 0.25)
    if killed_at is not None:  # not for a host that died by itself: when is unknown
        soak.failover_ms.append(round((time.monotonic() - killed_at) * 1000))
    host.dead = True
    host.fenced_by = str(entry.get("fenced_by"))
    soak.adopted[host.name] = list(entry.get("adopted", []))
    soak.not_adopted[host.name] = list(entry.get("not_adopted", []))


def restart_fenced(soak: Soak, host: Host) -> None:
    """Start the dead host again under its own name and state directory: it must
    find itself fenced (writer 77, supervisor 69), append nothing to its stream
    and change none of its agents' workspaces."""
    before_seq = stream_last(soak.urls, host.name)
    names = sorted({*host.agents, *_spec_names(host.state_dir)})
    before = {a: workspace(host.state_dir, a) for a in names}
    start(host)
    assert host.proc is not None
    try:
        code: int | None = host.proc.wait(90)
    except subprocess.TimeoutExpired:
        code = None
        kill_host(soak, host)
        soak.kills -= 1  # not a fault injected: the restart that did not stop
    host.alive = False
    host.fenced_restart_exit = code
    try:
        wait(lambda: not marked(host.marker), 15, f"restarted {host.name} gone", 0.1)
    except RuntimeError:
        soak.leaked += orphans(host.marker)
    after_seq = stream_last(soak.urls, host.name)
    changed = [a for a in names if workspace(host.state_dir, a) != before[a]]
    soak.fenced_restarts.append({"host": host.name, "exit": code,
                                 "stream_seq_before": before_seq, "stream_seq_after": after_seq,
                                 "workspaces_changed": changed})


def _spec_names(state_dir: StateDir) -> list[str]:
    directory = state_dir.config_dir / "agents"
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


def check_unplanned(soak: Soak) -> list[Host]:
    """A live host whose supervisor exited by itself was fenced while running (a
    status put late on a loaded machine): safe, but counted; its agents are
    adopted like a killed host's, and it is restarted and replaced like one."""
    found = []
    for host in soak.hosts:
        if host.alive and host.proc is not None and host.proc.poll() is not None:
            host.alive = False
            soak.unplanned_deaths.append(f"{host.name} exit {host.proc.returncode}")
            found.append(host)
    return found


def wait_fenced(soak: Soak, host: Host, timeout_s: float = 150) -> str:
    """The live host that fenced `host` (its member entry marked dead)."""
    def fenced() -> str:
        entry = fleet_entries(soak.urls)[1].get(host.name, {})
        return str(entry.get("fenced_by") or "") if entry.get("dead") else ""

    return str(wait(fenced, timeout_s, f"host {host.name} declared dead", 0.05))


def kill_cycle(soak: Soak, agents: int, node_kill_chance: float, fencer_kill_chance: float,
               generation: int) -> None:
    """Kill a random live host (now and then with its NATS node; now and then its
    fencer too, the moment it has fenced, before or while it adopts), wait until
    the fleet has adopted the victims' agents, then restart each victim under
    its own name (fenced) and start a fresh host in its place."""
    from supervisor.fleet import cluster

    live = [h for h in soak.hosts if h.alive]
    if len(live) < 2:
        raise RuntimeError(f"only {len(live)} live host(s): nobody would adopt")
    wait_bundles(soak)
    victim = soak.rng.choice(live)
    node_too = soak.rng.random() < node_kill_chance
    fencer_too = len(live) >= 3 and soak.rng.random() < fencer_kill_chance
    killed_at = time.monotonic()
    kill_host(soak, victim)
    if node_too:
        nodes = cluster.read_cluster(soak.root / "cluster")
        cluster.stop_node(nodes[victim.slot - 1], signal.SIGKILL)
        soak.node_kills += 1
        soak.node_down = victim.slot
    victims = [(victim, killed_at)]
    if fencer_too:
        fencer = next((h for h in soak.hosts if h.alive
                       and h.name == wait_fenced(soak, victim)), None)
        if fencer is not None:
            victims.append((fencer, time.monotonic()))
            kill_host(soak, fencer)
            soak.fencer_kills += 1
    for host, at in victims:
        wait_adopted(soak, host, at)
    if node_too:
        nodes = cluster.read_cluster(soak.root / "cluster")
        cluster.start_node(soak.root / "cluster", nodes[victim.slot - 1])
        cluster.wait_ready(soak.urls, 90)
        soak.node_down = None
    for host, _at in victims:
        replace(soak, host, agents, generation)


def replace(soak: Soak, host: Host, agents: int, generation: int) -> None:
    """The dead host started again under its name (fenced), then a fresh host in
    its slot under a new name, with new agents (started first: the two come up
    side by side, as they would on two machines)."""
    fresh = new_host(soak, f"{host.name.split('g')[0]}g{generation}", host.slot)
    soak.hosts.append(fresh)
    start(fresh)
    restart_fenced(soak, host)
    wait_up(soak, fresh)
    spawn_agents(soak, fresh, agents)


def owners(soak: Soak) -> dict[str, list[Host]]:
    """Agent -> the live hosts holding its spec (exactly one, if all is well)."""
    found: dict[str, list[Host]] = {}
    for host in soak.hosts:
        if host.alive:
            for name in _spec_names(host.state_dir):
                found.setdefault(name, []).append(host)
    return found


def wait_finished(soak: Soak, timeout_s: float) -> set[str]:
    """Until every agent that a live host holds has exited 0 there (one that no
    live host holds cannot finish: the checks report it `agents_unowned`)."""
    everyone = set(owners(soak))
    done: set[str] = set()
    controls = {h.name: Control(h.state_dir) for h in soak.hosts if h.alive}
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = set()
            for host in soak.hosts:
                if not host.alive:
                    continue
                children = controls[host.name].children() or []
                done |= {c.name for c in children if c.kind == "agent"
                         and c.state == "exited" and c.last_exit == "exit 0"}
            if everyone <= done:
                break
            time.sleep(0.5)
    finally:
        for control in controls.values():
            control.close()
    return done & everyone


def stop_hosts(hosts: list[Host]) -> dict[str, int | None]:
    """`supervisor stop` on every host at once (one after the other, a stopped
    host's status entry would expire and the others would fence it and adopt
    its agents: a stopped host is silent like a dead one); their exit codes."""
    stopping = [subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "stop", "--state-dir",
         str(host.state_dir.root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=_env(host), cwd=REPO_ROOT) for host in hosts]
    codes: dict[str, int | None] = {}
    for host, stop in zip(hosts, stopping, strict=True):
        assert host.proc is not None
        try:
            stop.wait(120)
            codes[host.name] = host.proc.wait(60)
        except subprocess.TimeoutExpired:
            for proc in _tree_pids(host.proc.pid):
                proc.kill()
            host.proc.wait()
            stop.kill()
            stop.wait()
            codes[host.name] = None
        host.alive = False
    return codes


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ops import soak_hostcheck
    from supervisor.fleet import buskeys, cluster, operatorsig

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="corral-shosts-",
                                                                     dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"hosts": args.hosts, "kill_host_interval_ms":
                               args.kill_host_interval_ms, "duration_s": args.duration,
                               "agents_per_host": args.agents, "task_repeat": args.task_repeat,
                               "seed": args.seed}
    started = time.monotonic()
    nodes = cluster.up(root / "cluster", 3)
    _private, public = operatorsig.make_keys(root / "keys" / "operator")
    soak = Soak(root, [n.url for n in nodes], public,
                buskeys.make_bus_secret(root / "keys" / "bus.secret"), args.task_repeat,
                random.Random(args.seed))
    tag = f"{os.getpid() % 1000:03d}"
    fresh_agents = args.agents if args.new_host_agents is None else args.new_host_agents
    stops: dict[str, int | None] = {}
    try:
        for i in range(args.hosts):
            soak.hosts.append(new_host(soak, f"h{i + 1}x{tag}g0", i % 3 + 1))
        for host in soak.hosts:
            start(host)
        for host in soak.hosts:
            wait_up(soak, host)
            spawn_agents(soak, host, args.agents)
        deadline = time.monotonic() + args.duration
        next_kill = time.monotonic() + args.kill_host_interval_ms / 1000
        generation = 0
        while time.monotonic() < deadline or soak.kills < args.min_kills:
            for host in check_unplanned(soak):
                generation += 1
                wait_adopted(soak, host, None)
                replace(soak, host, fresh_agents, generation)
            if time.monotonic() < next_kill:
                time.sleep(min(0.2, next_kill - time.monotonic()))  # pacing the faults
                continue
            generation += 1
            kill_cycle(soak, fresh_agents, args.node_kill_chance, args.fencer_kill_chance,
                       generation)
            next_kill = time.monotonic() + args.kill_host_interval_ms / 1000
        for host in check_unplanned(soak):
            generation += 1
            wait_adopted(soak, host, None)
            replace(soak, host, fresh_agents, generation)
        finished = wait_finished(soak, args.finish_timeout)
        owned = owners(soak)
        stops = stop_hosts([h for h in soak.hosts if h.alive])
        figures.update(soak_hostcheck.check(soak, finished, owned, stops))
        if args.tamper:  # the checks must catch planted faults (soak_hostcheck.tamper)
            planted = soak_hostcheck.tamper(soak)
            again = soak_hostcheck.check(soak, finished, owned, stops)
            figures["tamper"] = {"planted": planted, "detected": {
                k: again[k] - figures[k] for k in soak_hostcheck.TAMPERED}}
    except Exception as exc:  # noqa: BLE001 - reported as a violation, the JSON still printed
        soak.errors.append(f"{type(exc).__name__}: {str(exc)[:500]}")
    finally:
        for host in soak.hosts:
            if host.proc is not None and host.proc.poll() is None:
                for proc in _tree_pids(host.proc.pid):
                    try:
                        proc.kill()
                    except psutil.Error:
                        continue
                host.proc.wait(10)
        left = [line for host in soak.hosts for line in orphans(host.marker)]
        cluster.down(root / "cluster")
    figures.update(
        kills=soak.kills, node_kills=soak.node_kills, fencer_kills=soak.fencer_kills,
        live_hosts_expired=len(soak.live_hosts_expired),
        live_hosts_expired_list=sorted(set(soak.live_hosts_expired))[:10],
        adoptions=sum(len(a) for a in soak.adopted.values()),
        adopted=soak.adopted, not_adopted={k: v for k, v in soak.not_adopted.items() if v},
        failover_ms=soak.failover_ms, unplanned_deaths=soak.unplanned_deaths,
        fenced_restarts=soak.fenced_restarts, replacements=len(soak.hosts) - args.hosts,
        leaked=soak.leaked + left, orphans=len(soak.leaked) + len(left),
        supervisor_exits=stops, errors=soak.errors,
        elapsed_s=round(time.monotonic() - started, 1))
    figures["violations"] = soak_hostcheck.violations(figures)
    tampered = figures.get("tamper", {}).get("detected", {})
    figures["violations"] += [f"planted {k} not detected" for k, n in tampered.items() if n < 1]
    if args.tamper and not tampered:
        figures["violations"].append("--tamper: the faults were not planted")
    if args.keep or args.root:
        figures["kept"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ops/soak.py --hosts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, required=True, help="2 or 3 (one NATS node each)")
    parser.add_argument("--kill-host-interval-ms", type=int, required=True)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of killing")
    parser.add_argument("--agents", type=int, default=2, help="per host (and per new host)")
    parser.add_argument("--new-host-agents", type=int, default=None,
                        help="agents of each fresh host started in a victim's place "
                             "(default: --agents)")
    parser.add_argument("--task-repeat", type=int, default=60, help="passes per agent")
    parser.add_argument("--node-kill-chance", type=float, default=0.3,
                        help="share of host kills that take the host's NATS node too")
    parser.add_argument("--fencer-kill-chance", type=float, default=0.0,
                        help="share of host kills after which the host that fenced the "
                             "victim is killed too, the moment it fenced (3 hosts)")
    parser.add_argument("--adopt-delay-s", type=float, default=0.0,
                        help="fault: each agent's adoption sleeps this long first (a long "
                             "stream on a loaded host); the adopter must stay in the fleet")
    parser.add_argument("--min-kills", type=int, default=1,
                        help="go on past the duration until this many hosts were killed")
    parser.add_argument("--finish-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the state directories")
    parser.add_argument("--root", help="the run's directory (kept; default: a new one in "
                        "/tmp, removed at the end)")
    parser.add_argument("--tamper", action="store_true",
                        help="then plant one fault of each kind and check that the checks "
                             "report them (tamper.detected)")
    args = parser.parse_args(argv)
    global ADOPT_DELAY_S  # noqa: PLW0603 - set once, read by every host's environment
    ADOPT_DELAY_S = args.adopt_delay_s
    if not 2 <= args.hosts <= 3:
        parser.error("--hosts: 2 or 3 (one adopter must stay up; one node per host)")
    figures = run(args)
    print(json.dumps(figures, indent=2 if args.json else None, sort_keys=True))
    return 1 if figures["violations"] else 0
