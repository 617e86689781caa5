"""Fuzz a running corral runtime through every socket it listens on.

    python ops/fuzz.py --duration S [--json] [--seed N] [--rate FRAMES_PER_S]
        [--quiet S] [--no-storage-attacks]

Starts `supervisor up` in a temporary state directory (writer, broker, procs,
subagents and two idle agents), then for S seconds sends hostile frames to
run/writer.sock, run/supervisor.sock and run/broker.sock, and through the
broker to the broker itself, procs, subagents, the agents and names nobody
holds: random bytes, random msgpack values, valid messages with one field
replaced, the frames of issue 11 (a list for `kind`, `v: true`, the worst
frame within the limits, frames over the size limit, unsolicited errors that
once made two actors trade errors forever), wrong frame counts and, unless
--no-storage-attacks, valid appends that attack the storage side (hostile JSON
payloads, the longest stream names). It never sends a
*valid* request that acts (stop, signal, restart, spawn, commands, terminals,
subagents): those would be the runtime doing its job, not surviving.

Afterwards it checks that every process has the pid it had before, that
`supervisor wal verify` calls the WAL sound, that a normal append works, and
that every WAL line parses as JSON on its own (with `jq` when installed, else
Python's json). It counts `internal_errors` (replies with the code
`internal_error`: a fault without a name of its own; target 0, with their
details), and after --quiet seconds without traffic (default 30) the writer's
and the broker's `rss_growth_pct` against their RSS before the run (target
<= 20, docs/protocol.md, "Receivers"). It prints frames sent, typed errors
received, crashes and RSS before and after per process; exit 0 when
everything held. tests/test_fuzz.py runs the same for about 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import yaml
import zmq

from actors.writer.client import WriterClient
from actors.writer.wal import list_segments
from broker import auth, protocol
from broker.errors import CorralError, ProtocolError
from broker.statedir import StateDir
from supervisor.config import DEFAULT_CONFIG_PATH

AGENTS = 2
TARGETS = ("writer", "supervisor", "broker", "procs", "subagents", "agent", "nobody")
# Valid requests that would make the runtime act: the fuzzer never sends these valid.
ACTING_KINDS = frozenset({
    "stop_request", "signal_request", "restart_request", "spawn_request", "start_request",
    "remove_request", "reload_request", "bash", "bash_start",
    "bash_kill", "terminal_start", "terminal_input", "terminal_end", "session_end",
    "spawn_subagent", "apply_subagent",
})
Spawn = Callable[[Sequence[str], Path], subprocess.Popen[bytes]]


# --- frames --------------------------------------------------------------------------
def _worst_frame() -> bytes:
    body: dict[str, Any] = {"v": 1, "kind": "ping", "msg_id": "fz-worst"}
    body.update({f"k{i}": [[] for _ in range(1040)] for i in range(990)})
    frame: bytes = msgpack.packb(body)
    return frame


def _deep(levels: int) -> bytes:
    return b"\x91" * levels + b"\x01"


def special_frames(max_frame_bytes: int) -> list[bytes]:
    """The frames of issue 11 and their relatives, each one sent to every target."""
    pack = msgpack.packb
    return [
        pack({"v": 1, "kind": [], "msg_id": "x"}),  # the 22-byte frame (unhashable kind)
        pack({"v": 1, "kind": {}, "msg_id": "x"}),
        pack({"v": 1, "kind": "ping", "msg_id": []}),
        pack({"v": True, "kind": "ping", "msg_id": "fz-vtrue"}),
        pack({"v": 1.0, "kind": "ping", "msg_id": "fz-vfloat"}),
        pack({"v": 1, "kind": "heartbeat", "actor": "writer", "pid": 2**64 - 1}),
        pack({"v": 1, "kind": "bash_poll", "msg_id": "fz-c", "session": "s",
              "proc_id": "p-0123456789abcdef", "cursor": 2**64 - 1}),
        pack({"v": 1, "kind": "read_stream", "msg_id": "fz-nil", "stream": "s",
              "from_seq": None}),
        pack({b"v": 1, "kind": "ping", "msg_id": "fz-bkey"}),
        pack({"v": 1, "kind": "stats", "msg_id": "fz-k", "actor": "a", "values": {1: 2}}),
        pack({"v": 1, "kind": "ping", "msg_id": msgpack.ExtType(1, b"x")}),
        _deep(5000),
        _deep(20),
        b"\x81\xa1a" * 1000 + b"\x01",  # a map nested 1,000 deep: issue 38's RecursionError
        b"\x81\xa1a" * 20 + b"\x01",
        _worst_frame(),
        pack({"v": 1, "kind": "ping", "msg_id": "fz-big", "pad": b"x" * (max_frame_bytes + 10)}),
        protocol.encode(protocol.Error(msg_id="fz-err", code=protocol.ErrorCode.NOT_FOUND,
                                       detail="an unsolicited error")),
        protocol.encode(protocol.Error(code=protocol.ErrorCode.INTERNAL_ERROR, detail="e")),
        pack({"v": 1, "kind": "error", "msg_id": "fz-e2", "code": "no-such-code", "detail": 1}),
        protocol.encode(protocol.Pong(msg_id="fz-pong", actor="nobody", pid=1)),
        protocol.encode(protocol.Ack(msg_id="fz-ack", affected=[])),
        protocol.encode(protocol.AppendOk(msg_id="fz-ok", seq=1, duplicate=False)),
        b"",
        b"\xc1",
        os.urandom(64),
    ]


def storage_attacks() -> list[bytes]:
    """Valid appends that attack the storage side: hostile JSON payloads (the
    writer's payload policy) and the longest stream names (file names)."""
    nested = b"[" * 990 + b"]" * 990
    payloads = [nested, b'"\\ud800"', b"1e999", b"[1,\r2]", b"NaN", b"\xff", b'{"a":1}\n']
    frames = [
        protocol.encode(protocol.Append(msg_id=f"fz-pl-{i}", origin="fuzz", key=f"pl-{i}",
                                        stream="fuzz", event="fuzz", payload=payload))
        for i, payload in enumerate(payloads)
    ]
    frames += [
        protocol.encode(protocol.Append(msg_id=f"fz-name-{n}", origin="fuzz", key=f"name-{n}",
                                        stream="s" * n, event="fuzz", payload=b"{}"))
        for n in (126, 127, 128)
    ]
    return frames


class FrameSource:
    """Random hostile frames; never a valid request that acts."""

    def __init__(self, rng: random.Random, max_frame_bytes: int, storage: bool) -> None:
        self.rng = rng
        self.max_frame_bytes = max_frame_bytes
        self.storage = storage  # valid appends may carry any payload and stream name
        self.appends = 0
        self.plain_append = protocol.encode(protocol.Append(
            msg_id="fz-plain", origin="fuzz", key="plain", stream="fuzz", event="e",
            payload=b"{}"))
        self.templates = [protocol.encode(m) for m in _templates()]

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        choice = rng.randrange(12 if depth < 4 else 8)
        if choice == 0:
            return None
        if choice == 1:
            return rng.choice([True, False])
        if choice == 2:
            return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-999, 999)])
        if choice == 3:
            return rng.choice([0.0, 1.0, -1.5, float("inf"), float("nan"), 1e308])
        if choice == 4:
            return "".join(rng.choice("ab-_.:/ \u00e9\x00") for _ in range(rng.randrange(0, 9)))
        if choice == 5:
            return rng.randbytes(rng.randrange(0, 16))
        if choice == 6:
            return rng.choice(sorted(protocol.REQUEST_KINDS | protocol.REPLY_KINDS))
        if choice == 7:
            return "x" * rng.choice([64, 65, 128, 129, 300])
        if choice in (8, 9):
            return [self.value(depth + 1) for _ in range(rng.randrange(0, 4))]
        return {self.key(): self.value(depth + 1) for _ in range(rng.randrange(0, 4))}

    def key(self) -> Any:
        rng = self.rng
        if rng.random() < 0.9:
            return rng.choice(["v", "kind", "msg_id", "actor", "pid", "values", "stream",
                               "payload", "seq", "x", ""])
        return rng.choice([b"v", 1, -1])

    def frame(self) -> bytes:
        rng = self.rng
        if rng.random() < 0.05:  # a valid append now and then: the WAL must stay sound
            self.appends += 1
            return protocol.encode(protocol.Append(
                msg_id=f"fz-a{self.appends}", origin="fuzz", key=f"a{self.appends}",
                stream=f"fuzz-{rng.randrange(4)}", event="fuzzed",
                payload=json.dumps(self.value(), default=repr, skipkeys=True).encode()
                if self.storage else b'{"n":%d}' % self.appends))
        kind = rng.randrange(5)
        if kind == 0:
            return rng.randbytes(rng.randrange(0, 200))
        if kind == 1:
            return bytes(msgpack.packb(self.value(), use_bin_type=True))
        body = msgpack.unpackb(rng.choice(self.templates))
        if kind == 2:  # one field replaced
            body[rng.choice(sorted(body))] = self.value()
        elif kind == 3:  # one field removed, one added
            body.pop(rng.choice(sorted(body)), None)
            body[self.key()] = self.value()
        else:  # a frame cut anywhere
            whole = bytes(msgpack.packb(body, use_bin_type=True))
            return whole[: rng.randrange(0, len(whole) + 1)]
        frame = bytes(msgpack.packb(body, use_bin_type=True))
        try:
            message = protocol.decode(frame)
        except ProtocolError:
            return frame
        if message.kind in ACTING_KINDS:
            return bytes(msgpack.packb({"v": 1, "kind": "ping"}))
        if isinstance(message, protocol.Append) and not self.storage:
            return self.plain_append
        return frame


def _templates() -> list[protocol.Message]:
    pid = "p-0123456789abcdef"
    return [
        protocol.Ping(msg_id="t"),
        protocol.StatsRequest(msg_id="t"),
        protocol.StatusRequest(msg_id="t"),
        protocol.ReadStream(msg_id="t", stream="fuzz"),
        protocol.Append(msg_id="t", origin="fuzz", key="k", stream="fuzz", event="e",
                        payload=b"{}"),
        protocol.Heartbeat(actor="fuzz", pid=1),
        protocol.Ready(actor="fuzz", pid=1),
        protocol.BashPoll(msg_id="t", session="fuzz", proc_id=pid),
        protocol.TerminalRead(msg_id="t", session="fuzz", proc_id=pid),
        protocol.SubagentChanges(msg_id="t", parent="fuzz", subagent_id="latest"),
        protocol.SignalRequest(msg_id="t", target="nobody", signal=0 + 1),
        protocol.Bash(msg_id="t", session="fuzz", command="true", cwd="/"),
        protocol.Error(msg_id="t", code=protocol.ErrorCode.NOT_FOUND, detail="d"),
        protocol.ProcOutput(msg_id="t", proc_id=pid, cursor=0, next_cursor=0, data=b"",
                            state="exited"),
    ]


# --- the runtime ---------------------------------------------------------------------
def write_config(state: StateDir) -> Path:
    """The default configuration (every child), two idle agents, quicker status."""
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["heartbeat"] = {"interval_ms": 500, "timeout_s": 20}
    config["status_interval_s"] = 0.5
    config["broker"] = {"heartbeat_interval_ms": 500, "heartbeat_misses": 10}
    config["agents"]["count"] = AGENTS
    path = state.root.parent / "corral-fuzz.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_status(state: StateDir) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(state.status_path.read_text())
    except (OSError, ValueError):
        return None
    return data


def pids(state: StateDir) -> dict[str, int | None]:
    status = read_status(state) or {}
    out: dict[str, int | None] = {"supervisor": status.get("supervisor_pid")}
    for child in status.get("children", []):
        out[child["name"]] = child["pid"]
    return out


def _all_running(state: StateDir, names: int) -> bool:
    status = read_status(state)
    if status is None:
        return False
    children = status.get("children", [])
    return len(children) >= names and all(c["state"] == "running" for c in children)


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        rss: int = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None
    return round(rss / 2**20, 1)


# --- the run -------------------------------------------------------------------------
@dataclass
class Result:
    duration_s: float
    seed: int
    frames_sent: dict[str, int] = field(default_factory=dict)
    frames_total: int = 0
    typed_errors: int = 0
    internal_errors: int = 0
    internal_error_details: dict[str, int] = field(default_factory=dict)
    other_replies: int = 0
    undecodable_replies: int = 0
    crashes: int = 0
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)
    quiet_s: float = 0.0
    rss_growth_pct: dict[str, float | None] = field(default_factory=dict)
    wal_verify_sound: bool = False
    wal_verify_output: str = ""
    append_after_ok: bool = False
    append_error: str = ""
    wal_lines: int = 0
    wal_bad_lines: int = 0
    wal_parser: str = ""
    ok: bool = False  # everything held but memory
    rss_ok: bool = False  # every rss_growth_pct within RSS_GROWTH_MAX_PCT


class Fuzzer:
    def __init__(self, state: StateDir, rng: random.Random, storage: bool) -> None:
        self.state = state
        self.rng = rng
        self.source = FrameSource(rng, protocol.DEFAULT_LIMITS.max_frame_bytes, storage)
        self.specials = special_frames(protocol.DEFAULT_LIMITS.max_frame_bytes)
        if storage:
            self.specials += storage_attacks()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sent: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.internal: Counter[str] = Counter()  # internal_error replies by detail
        self._socks: dict[str, zmq.Socket[bytes]] = {}

    def _sock(self, target: str, identity: bytes | None) -> zmq.Socket[bytes]:
        key = f"{target}:{identity!r}"
        sock = self._socks.get(key)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * protocol.DEFAULT_LIMITS.max_frame_bytes)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            endpoint = {"writer": "writer", "supervisor": "supervisor"}.get(target, "broker")
            auth.authenticate(sock, self.state)  # the operator's: every frame gets through
            sock.connect(self.state.endpoint(endpoint))
            self._socks[key] = sock
        return sock

    def send(self, target: str, frame: bytes) -> None:
        rng = self.rng
        parts: list[bytes]
        if target in ("writer", "supervisor"):
            identity = rng.choice([None, b"fuzz-1", b"writer", b"\x00odd"])
            parts = [frame] if rng.random() < 0.95 else [frame, frame]
        else:
            identity = rng.choice([b"fuzz-a", b"fuzz-b", None])
            to = {"broker": b"broker", "procs": b"procs", "subagents": b"subagents",
                  "agent": f"agent-{rng.randrange(1, AGENTS + 1)}".encode(),
                  "nobody": rng.choice([b"nobody", b"bad name!", b"", b"\xff" * 70])}[target]
            parts = [to, frame] if rng.random() < 0.95 else rng.choice([[frame], [to, frame, to]])
        try:
            self._sock(target, identity).send_multipart(parts, zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        self.sent[target] += 1

    def drain(self) -> None:
        for sock in self._socks.values():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                try:
                    reply = protocol.decode(frames[-1])
                except ProtocolError:
                    self.replies["undecodable"] += 1
                    continue
                self.replies["error" if isinstance(reply, protocol.Error) else "other"] += 1
                if (isinstance(reply, protocol.Error)
                        and reply.code is protocol.ErrorCode.INTERNAL_ERROR):
                    self.internal[reply.detail[:200]] += 1

    def run(self, duration_s: float, rate: float) -> None:
        for frame in self.specials:  # every special frame to every target, first
            for target in TARGETS:
                self.send(target, frame)
            self.drain()
        deadline = time.monotonic() + duration_s
        batch = max(1, int(rate / 20))
        specials_every = 200
        sent = 0
        while time.monotonic() < deadline:
            started = time.monotonic()
            for _ in range(batch):
                sent += 1
                frame = (self.rng.choice(self.specials) if sent % specials_every == 0
                         else self.source.frame())
                self.send(self.rng.choice(TARGETS), frame)
            self.drain()
            time.sleep(max(0.0, batch / rate - (time.monotonic() - started)))
        # give the receivers a moment to answer what is queued, then read it
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            self.drain()
            time.sleep(0.05)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self.ctx.term()


def check_wal_lines(state: StateDir) -> tuple[int, int, str]:
    """(lines, lines that are not one JSON value each, parser used)."""
    segments = [path for _, path in list_segments(state.wal_dir)]
    lines = sum(path.read_bytes().count(b"\n") for path in segments)
    jq = shutil.which("jq")
    if jq is not None:
        bad = 0
        for path in segments:
            data = path.read_bytes()
            whole = subprocess.run([jq, "-c", "."], input=data, capture_output=True, check=False)
            if whole.returncode == 0 and whole.stdout.count(b"\n") == data.count(b"\n"):
                continue  # one JSON value per line, every line
            for line in data.splitlines():  # find the bad lines one by one
                done = subprocess.run([jq, "-c", "."], input=line, capture_output=True,
                                      check=False)
                bad += done.returncode != 0 or done.stdout.count(b"\n") != 1
        return lines, bad, "jq"
    bad = 0
    for path in segments:
        for line in path.read_bytes().splitlines():
            try:
                json.loads(line)
            except ValueError:
                bad += 1
    return lines, bad, "python-json"


def _default_spawn(argv: Sequence[str], out: Path) -> subprocess.Popen[bytes]:
    with out.open("ab") as fh:
        return subprocess.Popen([sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)


RSS_GROWTH_MAX_PCT = 20.0
MEASURED = ("writer", "broker")  # the servers whose memory must come back


def run(duration_s: float, *, seed: int | None = None, rate: float = 1000.0,
        storage: bool = True, spawn: Spawn = _default_spawn,
        workdir: Path | None = None, quiet_s: float = 30.0) -> Result:
    """Start a runtime, fuzz it for `duration_s`, let it be quiet for
    `quiet_s`, check it, stop it."""
    seed = seed if seed is not None else random.randrange(2**32)
    root = workdir or Path(tempfile.mkdtemp(prefix="corral-fuzz-", dir="/tmp"))
    state = StateDir(root / ".corral").ensure()
    config = write_config(state)
    result = Result(duration_s=duration_s, seed=seed)
    supervisor = spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state.root),
                        "--config", str(config)], root / "supervisor.out")
    try:
        _wait(lambda: _all_running(state, 4 + AGENTS) or supervisor.poll() is not None, 90,
              "every child running")
        if supervisor.poll() is not None:
            raise RuntimeError(f"the supervisor exited {supervisor.returncode}")
        before = pids(state)
        rss_before = {name: _rss_mb(pid) for name, pid in before.items()}
        fuzzer = Fuzzer(state, random.Random(seed), storage)
        try:
            fuzzer.run(duration_s, rate)
        finally:
            fuzzer.close()
        # the status file is rewritten every status interval: wait for a fresh one
        written = state.status_path.stat().st_mtime_ns
        _wait(lambda: state.status_path.stat().st_mtime_ns != written
              or supervisor.poll() is not None, 30, "a fresh status file")
        after = pids(state) if supervisor.poll() is None else {}
        result.quiet_s = quiet_s
        quiet_until = time.monotonic() + quiet_s
        while time.monotonic() < quiet_until and supervisor.poll() is None:
            time.sleep(0.5)  # a duration to measure after, not a wait for a condition
        for name in MEASURED:
            grown = _rss_mb(after.get(name))
            start = rss_before.get(name)
            result.rss_growth_pct[name] = (None if grown is None or not start else
                                           round(100.0 * (grown - start) / start, 1))
        for name, pid in before.items():
            result.processes[name] = {"pid_before": pid, "pid_after": after.get(name),
                                      "rss_before_mb": rss_before[name],
                                      "rss_after_mb": _rss_mb(after.get(name))}
        result.crashes = sum(1 for name, pid in before.items() if after.get(name) != pid)
        result.frames_sent = dict(fuzzer.sent)
        result.frames_total = sum(fuzzer.sent.values())
        result.typed_errors = fuzzer.replies["error"]
        result.internal_errors = sum(fuzzer.internal.values())
        result.internal_error_details = dict(fuzzer.internal.most_common(10))
        result.other_replies = fuzzer.replies["other"]
        result.undecodable_replies = fuzzer.replies["undecodable"]
        with zmq.Context() as ctx:
            writer = WriterClient(ctx, state, "fuzz-check")
            try:
                writer.append("fuzz-check", "checked", {"ok": True}, key="after-fuzz")
                result.append_after_ok = True
            except CorralError as exc:
                result.append_error = str(exc)[:500]
            finally:
                writer.close()
    finally:
        if supervisor.poll() is None:
            supervisor.send_signal(signal.SIGTERM)
            try:
                supervisor.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(supervisor.pid, signal.SIGKILL)
                supervisor.wait()
    verify = subprocess.run([sys.executable, "-m", "supervisor.cli", "wal", "verify",
                             "--state-dir", str(state.root)],
                            capture_output=True, text=True, check=False)
    result.wal_verify_sound = verify.returncode == 0
    result.wal_verify_output = (verify.stdout + verify.stderr)[-2000:]
    result.wal_lines, result.wal_bad_lines, result.wal_parser = check_wal_lines(state)
    result.ok = (result.crashes == 0 and result.wal_verify_sound and result.append_after_ok
                 and result.wal_bad_lines == 0 and result.undecodable_replies == 0
                 and result.internal_errors == 0)
    result.rss_ok = all(pct is not None and pct <= RSS_GROWTH_MAX_PCT
                        for pct in result.rss_growth_pct.values())
    if workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ops/fuzz.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of fuzzing")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--rate", type=float, default=1000.0, help="frames per second")
    parser.add_argument("--no-storage-attacks", action="store_true",
                        help="leave out valid appends with hostile payloads or stream names")
    parser.add_argument("--quiet", type=float, default=30.0,
                        help="seconds without traffic before the RSS is measured again")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.duration, seed=args.seed, rate=args.rate,
                 storage=not args.no_storage_attacks, quiet_s=args.quiet)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(f"fuzzed {result.duration_s}s (seed {result.seed}): {result.frames_total} frames, "
              f"{result.typed_errors} typed errors ({result.internal_errors} internal_error), "
              f"{result.crashes} crashes, RSS growth after {result.quiet_s}s quiet "
              f"{result.rss_growth_pct}; WAL sound: "
              f"{result.wal_verify_sound}; append after: {result.append_after_ok}; "
              f"WAL lines bad ({result.wal_parser}): {result.wal_bad_lines}/{result.wal_lines}")
        for name, figures in result.processes.items():
            print(f"  {name}: {figures}")
    return 0 if result.ok and result.rss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
