"""`python ops/bench.py spawn`: how many idle agents the supervisor keeps up,
how fast they start and restart, what they cost in memory, how fast
`supervisor status --json` answers.

Figures:
    fresh_interpreter_ready_ms  baseline: `python -m actors.agent` in a new
                                interpreter, spawn to its `ready` (median)
    agents_alive                the largest of 50 / 200 / 500 where every agent
                                came up and answered a ping through the broker
    spawn_ready_ms_p50          supervisor's fork request to the agent's `ready`,
                                during the ramp of all agents at once
    spawn_ready_single_ms_p50   the same for one agent spawned alone (the restarted
                                ones), the others idle
    uss_mib_median / pss_mib_median   per idle agent, at the largest size
    restart_ready_ms_p50        SIGKILL of an idle agent to its successor's
                                `actor_ready` in the supervisor's log
    status_cli_ms_p50           `supervisor status --json` as a whole command

Where `spawn_ready_ms` goes, same run (the supervisor logs at `info` here, so
its `actor_spawned` lines time the zygote's replies):
    spawn_forked_to_ready_ms_p50  the zygote's `forked` reply to `ready`: the
                                agent's own start (logging, zmq, two
                                authenticated connections, `ready`)
    spawn_request_to_forked_ms_p50  the rest: the fork request's wait in the
                                zygote's queue and its fork
    zygote_clone_ms_p50         one clone(CLONE_PARENT) (actors/sibling.py: the
                                child is the caller's parent's; reaped there)
                                of a process preloaded as the zygote is: what
                                each agent's start pays for its fork where the
                                zygote clones (x86_64 glibc); absent elsewhere
    zygote_double_fork_ms_p50   one double fork (fork, the go-between forks and
                                exits, waitpid) of the same process: what each
                                start pays without the clone (`--double-fork`)
    zygote_fork_ms_p50          one plain fork (and the child's exit, waitpid)
                                of the same process

What a start's page faults cost on this machine, same run (a forked start
is mostly page faults: docs/performance.md, "What bounds the misses"; on a
VM that hands free memory back to its host, a page the host no longer backs
also faults there, and the same faults cost more):
    page_fault_us               one first write to a fresh anonymous page (a
                                child maps 64 MiB and writes a byte a page),
                                before the ramp and after it (`_after`): the
                                guest's own cost of a fault, a floor (its
                                pages come warm from the guest's lists)
    agent_minor_faults_median   minor faults of an idle agent of the largest
                                size since its fork (/proc/<pid>/stat)

What the ramp of the largest size cost, from the first agent's `ready` to the
last one's (`RampCpu`; per agent started in between):
    ramp_cpu_ms_per_start       CPU of the supervisor's whole tree, and by kind
                                (`_supervisor`, `_zygote` with the go-betweens
                                it reaped, `_agents`: their start and their
                                beats, `_broker`, `_writer`, `_procs`,
                                `_subagents`, `_other`)
    ramp_cores_ours / ramp_cores_machine  cores busy on average with that
                                tree's work / with anything (/proc/stat): the
                                difference is what other work on the machine
                                took; with AGENTS_STARTING agents starting at
                                once a start takes about AGENTS_STARTING x
                                ramp_cpu_ms_per_start / ramp_cores_ours
                                (Little's law)

The supervisor asks the zygote for at most AGENTS_STARTING agents not yet
ready (supervisor/runtime/starter.py), so `spawn_ready_ms` is one agent's start on a
machine shared with the others starting; the ramp of all of them is
`n<count>_all_running_s`, from `supervisor up` to the last agent's
`actor_ready` (docs/decisions.md, "Agents fork from a zygote: one clone, a
pool, paced starts"). The bench follows the ramp and the restarts in the
supervisor's log, not by `status` requests: a status of 500 children every
0.2 s took a tenth of a core from the supervisor during the ramp it measured.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml
import zmq

from broker import auth, protocol
from broker.peer import BrokerPeer
from broker.requester import Requester, new_msg_id
from broker.statedir import StateDir

REPO = Path(__file__).resolve().parent.parent


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("CORRAL_CONTROL", None)
    env.update(extra or {})
    return env


def fresh_interpreter_ready_ms(root: Path, runs: int) -> float:
    """Spawn `python -m actors.agent` and time it to its `ready` on our own ROUTER."""
    state = StateDir(root / "fresh" / ".corral").ensure()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth.stand_in_server(ctx, router, state)
    router.bind(state.endpoint("supervisor"))
    times = []
    try:
        for i in range(runs):
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "actors.agent", "--name", f"fresh-{i}", "--state-dir",
                 str(state.root), "--no-broker"],
                env=_env({"CORRAL_CONTROL": state.endpoint("supervisor")}),
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            while True:
                if not router.poll(30_000):
                    raise RuntimeError("fresh agent never sent ready")
                _, frame = router.recv_multipart()
                if isinstance(protocol.decode(frame), protocol.Ready):
                    break
            times.append((time.perf_counter() - t0) * 1000)
            proc.terminate()
            proc.wait(10)
    finally:
        router.close()
        ctx.term()
    return round(statistics.median(times), 1)


def zygote_fork_ms(runs: int) -> tuple[float, float, float | None]:
    """(one double fork as the zygote makes it (actors/zygote.py `_fork`), one
    plain fork, one clone(CLONE_PARENT) or None where there is none), medians
    in ms, in a child process preloaded as the zygote is (its imports,
    gc.freeze). The clones' children are ours (the preloaded process's
    parent's): reaped here."""
    code = (
        "import os, statistics, sys, time\n"
        "from actors import zygote\n"
        "try:\n"
        "    from actors import sibling\n"
        "    cloning = sibling.available()\n"
        "except ImportError:  # a tree before the clone (an A/B run)\n"
        "    cloning = False\n"
        "zygote._preload()\n"
        "clones = []\n"
        f"for _ in range({runs} if cloning else 0):\n"
        "    t = time.perf_counter()\n"
        "    r, w = os.pipe()\n"
        "    pid = sibling.fork_sibling()\n"
        "    if pid == 0:\n"
        "        os.write(w, b'x')\n"
        "        os._exit(0)\n"
        "    os.close(w)\n"
        "    os.read(r, 1)\n"
        "    os.close(r)\n"
        "    clones.append((time.perf_counter() - t) * 1000)\n"
        "    print('clone', pid, flush=True)\n"
        "single = []\n"
        f"for _ in range({runs}):\n"
        "    t = time.perf_counter()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    single.append((time.perf_counter() - t) * 1000)\n"
        "times = []\n"
        f"for _ in range({runs}):\n"
        "    t = time.perf_counter()\n"
        "    r, w = os.pipe()\n"
        "    middle = os.fork()\n"
        "    if middle == 0:\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            os._exit(0)\n"
        "        os.write(w, str(pid).encode())\n"
        "        os._exit(0)\n"
        "    os.close(w)\n"
        "    os.read(r, 64)\n"
        "    os.close(r)\n"
        "    os.waitpid(middle, 0)\n"
        "    times.append((time.perf_counter() - t) * 1000)\n"
        "print(statistics.median(times), statistics.median(single),\n"
        "      statistics.median(clones) if clones else -1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE,
                            text=True)
    out, _ = proc.communicate(timeout=300)
    for line in out.splitlines():  # the clones' children are ours: reap them
        if line.startswith("clone "):
            os.waitpid(int(line.split()[1]), 0)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    double, single, clone = out.strip().splitlines()[-1].split()
    return (round(float(double), 2), round(float(single), 2),
            round(float(clone), 2) if float(clone) >= 0 else None)


def _log_times(state: StateDir) -> tuple[list[float], list[float]]:
    """Per agent, from the supervisor's log: (fork request to the zygote's
    `forked` reply, that reply to `ready`) in ms; the request's time is the
    `ready` time less the supervisor's own `ready_ms`."""
    from datetime import datetime

    spawned: dict[str, float] = {}
    to_forked: list[float] = []
    to_ready: list[float] = []
    try:
        lines = (state.logs_dir / "supervisor.log").read_text().splitlines()
    except OSError:
        return [], []
    for line in lines:
        try:
            doc = json.loads(line)
            child = str(doc.get("child", ""))
            at = datetime.fromisoformat(str(doc["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        if not child.startswith("agent"):
            continue
        if doc.get("event") == "actor_spawned":
            spawned[child] = at
        elif doc.get("event") == "actor_ready" and child in spawned \
                and isinstance(doc.get("ready_ms"), int | float):
            forked_to_ready = (at - spawned.pop(child)) * 1000
            to_ready.append(forked_to_ready)
            to_forked.append(float(doc["ready_ms"]) - forked_to_ready)
    return to_forked, to_ready


class ReadyLog:
    """The supervisor's `actor_ready` lines as its log grows: (child, pid,
    wall-clock time) of each one not seen before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._tail = b""

    def new(self) -> list[tuple[str, int | None, float]]:
        from datetime import datetime

        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except OSError:
            return []
        self._offset += len(chunk)
        *lines, self._tail = (self._tail + chunk).split(b"\n")
        out = []
        for line in lines:
            if b'"actor_ready"' not in line:
                continue
            try:
                doc = json.loads(line)
                at = datetime.fromisoformat(
                    str(doc["timestamp"]).replace("Z", "+00:00")).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            pid = doc.get("pid")
            out.append((str(doc.get("child", "")), pid if isinstance(pid, int) else None, at))
        return out


def _busy_jiffies() -> tuple[int, int]:
    """(busy, all) CPU time of the whole machine so far (/proc/stat, jiffies)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class RampCpu:
    """CPU spent during a ramp by the supervisor's tree, by kind of process,
    and by the whole machine: `mark()` at the first agent ready and at the
    last; `figures()` per agent started between the two."""

    def __init__(self, supervisor_pid: int) -> None:
        self.pid = supervisor_pid
        self.first: tuple[int, float, dict[int, tuple[str, float]], tuple[int, int]] | None = None
        self.last: tuple[int, float, dict[int, tuple[str, float]], tuple[int, int]] | None = None

    def _tree(self) -> dict[int, tuple[str, float]]:
        """pid -> (kind, CPU seconds); the zygote's include its reaped
        children's (the go-betweens of a double fork)."""
        out: dict[int, tuple[str, float]] = {}
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return out
        forked: list[tuple[float, int, float, float]] = []  # the zygote's argv
        for proc in procs:
            try:
                cmd = " ".join(proc.cmdline())
                times = proc.cpu_times()
                born = proc.create_time()
            except psutil.Error:
                continue
            own = times.user + times.system
            if proc.pid == self.pid:
                out[proc.pid] = ("supervisor", own)
            elif "actors.zygote" in cmd:  # the zygote, or an agent (its argv is the zygote's)
                forked.append((born, proc.pid, own, times.children_user + times.children_system))
            else:
                kind = next((k for k, mod in (("writer", "actors.writer"), ("broker", "broker."),
                                              ("procs", "actors.procs"),
                                              ("subagents", "actors.subagents"))
                             if mod in cmd), "other")
                out[proc.pid] = (kind, own)
        for i, (_born, pid, own, reaped) in enumerate(sorted(forked)):
            out[pid] = ("zygote", own + reaped) if i == 0 else ("agents", own)
        return out

    def mark(self, ready: int) -> None:
        snap = (ready, time.monotonic(), self._tree(), _busy_jiffies())
        if self.first is None:
            self.first = snap
        else:
            self.last = snap

    def figures(self) -> dict[str, float]:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        started = self.last[0] - self.first[0]
        wall_s = self.last[1] - self.first[1]
        before, after = self.first[2], self.last[2]
        spent: dict[str, float] = {}
        for pid, (kind, cpu) in after.items():
            spent[kind] = spent.get(kind, 0.0) + cpu - before.get(pid, (kind, 0.0))[1]
        busy = self.last[3][0] - self.first[3][0]
        total = self.last[3][1] - self.first[3][1]
        cores = os.cpu_count() or 1
        out = {f"ramp_cpu_ms_per_start_{k}": round(v * 1000 / started, 2)
               for k, v in sorted(spent.items())}
        ours = sum(spent.values())
        out["ramp_cpu_ms_per_start"] = round(ours * 1000 / started, 2)
        out["ramp_cores_ours"] = round(ours / wall_s, 2)
        out["ramp_cores_machine"] = round(cores * busy / total, 2) if total else 0.0
        return out


class Run:
    """One `supervisor up` with `count` idle agents (or, given `prepare`, agents
    whose specs it writes: it may change the configuration before the start)."""

    def __init__(self, root: Path, count: int,
                 prepare: Callable[[StateDir, dict[str, Any]], None] | None = None) -> None:
        self.state = StateDir(root / f"n{count}" / ".corral").ensure()
        self.count = count
        config = yaml.safe_load((REPO / "config" / "default.yaml").read_text())
        config["agents"]["count"] = count
        self.agent_prefix = str(config["agents"].get("name_prefix", "agent-"))
        pool = os.environ.get("CORRAL_BENCH_ZYGOTE_POOL")  # an A/B of the zygote's pool
        if pool is not None:
            config["agents"]["zygote_pool"] = int(pool)
        config["logging"]["level"] = "info"  # the supervisor's actor_spawned lines
        if prepare is not None:
            prepare(self.state, config)
        self.config_path = self.state.root.parent / "bench.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.out = (self.state.root.parent / "up.out").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "up", "--state-dir", str(self.state.root),
             "--config", str(self.config_path)],
            env=_env(), stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.requester: Requester | None = None
        self.readies = ReadyLog(self.state.logs_dir / "supervisor.log")
        self.ramp_cpu = RampCpu(self.proc.pid)

    def status(self) -> list[protocol.ChildStatus]:
        if self.requester is None:
            self.requester = Requester(self.ctx, self.state.endpoint("supervisor"))
        reply = self.requester.request(protocol.StatusRequest(msg_id=new_msg_id("b")),
                                       timeout_s=5.0, retries=2)
        assert isinstance(reply, protocol.StatusReply)
        return reply.children

    def agents(self) -> list[protocol.ChildStatus]:
        return [c for c in self.status() if c.kind == "agent"]

    def wait_all_running(self, timeout_s: float) -> list[protocol.ChildStatus]:
        deadline = time.monotonic() + timeout_s
        while not self.state.status_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"supervisor did not start (exit {self.proc.poll()})")
            time.sleep(0.05)
        while True:
            children = self.status()
            if all(c.state == "running" for c in children):
                return [c for c in children if c.kind == "agent"]
            if time.monotonic() > deadline:
                return [c for c in children if c.kind == "agent" and c.state == "running"]
            time.sleep(0.2)

    def wait_agents_ready_logged(self, timeout_s: float) -> float | None:
        """Wait until every agent's `actor_ready` is in the supervisor's log
        (read as it grows: no status request loads the supervisor's loop
        during the ramp, as polling `status` for 500 children every 0.2 s
        did); the wall-clock time of the last one, None at the timeout.
        Meanwhile `self.ramp_cpu` takes the CPU spent from the first agent's
        `ready` seen to the last one's (`RampCpu`)."""
        deadline = time.monotonic() + timeout_s
        ready: dict[str, float] = {}
        while len(ready) < self.count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return None
            for child, _pid, at in self.readies.new():
                if child.startswith(self.agent_prefix):
                    ready[child] = at
            if ready and self.ramp_cpu.first is None:
                self.ramp_cpu.mark(len(ready))
            if len(ready) < self.count:
                time.sleep(0.05)
        self.ramp_cpu.mark(len(ready))
        return max(ready.values()) if ready else time.time()

    def pinged(self, names: list[str]) -> int:
        """How many agents answer a ping through the broker."""
        peer = BrokerPeer(self.ctx, self.state, "bench-pinger")
        answered = 0
        try:
            for name in names:
                try:
                    reply = peer.request(name, protocol.Ping(msg_id=new_msg_id("p")),
                                         timeout_s=2.0, retries=1)
                except Exception:  # noqa: BLE001 - an unanswered ping is just not counted
                    continue
                answered += isinstance(reply, protocol.Pong)
        finally:
            peer.close()
        return answered

    def restart_ready_ms(self, victims: list[protocol.ChildStatus]) -> list[float]:
        """SIGKILL of each victim to its successor's `actor_ready` (the
        supervisor's log, read as it grows; no status request meanwhile)."""
        times = []
        self.readies.new()  # what is logged already
        for victim in victims:
            assert victim.pid is not None
            t0 = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            while time.time() - t0 <= 10:
                seen = [at for child, pid, at in self.readies.new()
                        if child == victim.name and pid != victim.pid]
                if seen:
                    times.append((seen[0] - t0) * 1000)
                    break
                time.sleep(0.002)
        return times

    def status_cli_ms(self, runs: int) -> tuple[list[float], int]:
        """Times of the answered runs, and how many got no answer in time
        (exit 4: the supervisor did not answer within the CLI's timeout)."""
        times = []
        unanswered = 0
        for _ in range(runs):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "supervisor.cli", "status", "--json",
                                   "--state-dir", str(self.state.root)],
                                  env=_env(), stdout=subprocess.DEVNULL, check=False)
            if done.returncode == 0:
                times.append((time.perf_counter() - t0) * 1000)
            elif done.returncode == 4:
                unanswered += 1
            else:
                raise subprocess.CalledProcessError(done.returncode, done.args)
        return times, unanswered

    def stop(self) -> None:
        if self.requester is not None:
            self.requester.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.ctx.destroy(linger=0)
        self.out.close()


PROBE_BYTES = 64 << 20


def _touch_pages(out: Any) -> None:
    page = mmap.PAGESIZE
    area = mmap.mmap(-1, PROBE_BYTES)
    started = time.perf_counter()
    for offset in range(0, PROBE_BYTES, page):
        area[offset] = 1
    out.send((time.perf_counter() - started) / (PROBE_BYTES // page) * 1e6)
    out.close()


def page_fault_us() -> float:
    """The cost of one first write to a fresh anonymous page, in a new child
    (what each of a forked start's faults costs here, its copies on write
    aside), median of 3."""
    ctx = mp.get_context("fork")
    costs: list[float] = []
    for _ in range(3):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_touch_pages, args=(send,))
        child.start()
        send.close()
        costs.append(float(recv.recv()))
        child.join()
    return round(statistics.median(costs), 2)


def _minor_faults(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[7])  # minflt: the 10th field, the 8th after the name


def _memory_mib(pids: list[int]) -> tuple[float, float]:
    uss, pss = [], []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            continue
        uss.append(info.uss / 1048576)
        pss.append(info.pss / 1048576)
    return round(statistics.median(uss), 2), round(statistics.median(pss), 2)


def run(quick: bool) -> dict[str, object]:
    sizes = [10, 50] if quick else [50, 200, 500]
    figures: dict[str, Any] = {"sizes_tried": sizes, "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="cb-", dir="/tmp") as tmp:
        root = Path(tmp)
        figures["fresh_interpreter_ready_ms"] = fresh_interpreter_ready_ms(root, 3 if quick else 5)
        figures["page_fault_us"] = page_fault_us()
        alive = 0
        for count in sizes:
            bench = Run(root, count)
            t0 = time.time()  # `supervisor up` started
            try:
                last_ready = bench.wait_agents_ready_logged(timeout_s=60 + count * 0.2)
                running = bench.wait_all_running(timeout_s=10 if last_ready else 1)
                up_s = (last_ready or time.time()) - t0
                answered = bench.pinged([c.name for c in running])
                figures[f"n{count}_running"] = len(running)
                figures[f"n{count}_answered_ping"] = answered
                figures[f"n{count}_all_running_s"] = round(up_s, 2)
                if answered < count:
                    break
                alive = count
                if count == sizes[-1]:
                    ready = [c.values["ready_ms"] for c in running if "ready_ms" in c.values]
                    figures["spawn_ready_ms_p50"] = round(statistics.median(ready), 2)
                    figures["spawn_ready_ms_p90"] = round(
                        statistics.quantiles(ready, n=10)[-1], 2)
                    figures.update(bench.ramp_cpu.figures())
                    to_forked, to_ready = _log_times(bench.state)
                    if to_ready:
                        figures["spawn_request_to_forked_ms_p50"] = round(
                            statistics.median(to_forked), 2)
                        figures["spawn_forked_to_ready_ms_p50"] = round(
                            statistics.median(to_ready), 2)
                    uss, pss = _memory_mib([c.pid for c in running if c.pid])
                    faults = [f for c in running if c.pid
                              and (f := _minor_faults(c.pid)) is not None]
                    if faults:
                        figures["agent_minor_faults_median"] = statistics.median(faults)
                    figures["uss_mib_median"] = uss
                    figures["pss_mib_median"] = pss
                    sup = psutil.Process(bench.proc.pid)
                    figures["supervisor_rss_mib"] = round(sup.memory_info().rss / 1048576, 1)
                    cli, unanswered = bench.status_cli_ms(5 if quick else 9)
                    if cli:
                        figures["status_cli_ms_p50"] = round(statistics.median(cli), 1)
                    figures["status_cli_unanswered"] = unanswered
                    victims = running[:: max(1, len(running) // 10)][:10]
                    restarts = bench.restart_ready_ms(victims)
                    figures["restart_ready_ms_p50"] = round(statistics.median(restarts), 1)
                    figures["restarts_measured"] = len(restarts)
                    # the restarted agents' own spawn latency: one fork, 500 siblings idle
                    again = {c.name: c for c in bench.agents()}
                    single = [again[v.name].values["ready_ms"] for v in victims
                              if "ready_ms" in again[v.name].values]
                    figures["spawn_ready_single_ms_p50"] = round(statistics.median(single), 2)
            finally:
                bench.stop()
        figures["agents_alive"] = alive
        figures["page_fault_us_after"] = page_fault_us()
        double_ms, single_ms, clone_ms = zygote_fork_ms(10 if quick else 30)
        figures["zygote_double_fork_ms_p50"] = double_ms
        figures["zygote_fork_ms_p50"] = single_ms
        if clone_ms is not None:
            figures["zygote_clone_ms_p50"] = clone_ms
    return figures
