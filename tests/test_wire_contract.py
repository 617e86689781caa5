"""docs/protocol.md is the contract (issue 38): a client written from that page
alone (pyzmq, msgpack and hmac; no corral module) drives a runtime started
with `supervisor up` through every documented request of the writer, the
broker, the control socket and procs, and checks that each reply has
exactly the fields the page lists. It found the control socket refusing
`ping`/`stats_request` that the page allows (now answered)."""

from __future__ import annotations

import hashlib
import hmac
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
import zmq

from tests.processes import ProcessTracker, wait_for

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]
Ctx = zmq.Context[zmq.Socket[bytes]]

# every reply kind and its fields, as docs/protocol.md lists them (`v`, `kind` apart)
REPLY_FIELDS: dict[str, set[str]] = {
    "pong": {"msg_id", "actor", "pid"},
    "stats": {"msg_id", "actor", "values"},
    "error": {"msg_id", "code", "detail"},
    "append_ok": {"msg_id", "seq", "duplicate"},
    "append_many_ok": {"msg_id", "seq", "count", "prev_seq", "duplicate"},
    "records": {"msg_id", "stream", "records", "next_seq", "more", "head_seq"},
    "status_reply": {"msg_id", "supervisor_pid", "state_dir", "started_at", "children"},
    "ack": {"msg_id", "affected"},
    "reload_reply": {"msg_id", "config", "started", "stopped", "restarted", "unchanged"},
    "heartbeat": {"actor", "pid", "values", "busy", "msg_id"},
    "proc_status": {"msg_id", "proc_id", "state", "pid", "exit_code", "log_bytes", "ended"},
    "proc_output": {"msg_id", "proc_id", "cursor", "next_cursor", "data", "state",
                    "exit_code", "eof"},
}
CHILD_STATUS = {"name", "kind", "pid", "state", "uptime_s", "restarts", "last_exit",
                "cpu_percent", "rss_bytes", "uss_bytes", "heartbeat_age_s", "values", "busy"}
TASK = "name: contract\nprompt: say done\nsteps:\n  - {op: finish, summary: done}\n"


class DocClient:
    """Credentials, frames and request/reply exactly as docs/protocol.md says."""

    def __init__(self, ctx: Ctx, state: Path) -> None:
        self.ctx = ctx
        self.state = state
        self.master = (state / "keys" / "master.key").read_bytes()
        lines = (state / "keys" / "operator.key").read_bytes().split(b"\n")
        assert lines[0] == b"corral-credential-v1" and lines[1] == b"operator"
        self.operator_secret = lines[2]
        self._n = 0

    def secret(self, name: str) -> bytes:
        if name == "operator":
            return self.operator_secret
        return hmac.new(self.master, b"actor:" + name.encode(),
                        hashlib.sha256).hexdigest().encode()

    def dealer(self, server: str, name: str, identity: bytes | None = None) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.PLAIN_USERNAME, name.encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, self.secret(name))
        sock.connect(f"ipc://{self.state}/run/{server}.sock")
        return sock

    def ask(self, sock: zmq.Socket[bytes], kind: str, to: bytes | None = None,
            timeout_s: float = 20.0, **fields: Any) -> dict[str, Any]:
        """Send one request; its reply (matched by msg_id), fields checked."""
        self._n += 1
        msg_id = f"doc-{self._n}"
        body = msgpack.packb({"v": 1, "kind": kind, "msg_id": msg_id, **fields},
                             use_bin_type=True)
        sock.send_multipart([body] if to is None else [to, body])
        deadline = time.monotonic() + timeout_s
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            frames = sock.recv_multipart()
            reply = msgpack.unpackb(frames[-1], raw=False)
            if reply.get("msg_id") == msg_id:
                check_fields(reply)
                return dict(reply)
        raise AssertionError(f"no reply to {kind} within {timeout_s}s")


def check_fields(reply: dict[str, Any]) -> None:
    assert reply["v"] == 1 and type(reply["v"]) is int, reply
    fields = set(reply) - {"v", "kind"}
    assert fields == REPLY_FIELDS[reply["kind"]], (reply["kind"], sorted(fields))
    if reply["kind"] == "status_reply":
        for child in reply["children"]:
            assert set(child) == CHILD_STATUS, sorted(child)


def expect(reply: dict[str, Any], kind: str, **values: Any) -> dict[str, Any]:
    assert reply["kind"] == kind, reply
    for name, value in values.items():
        assert reply[name] == value, (name, reply)
    return reply


@pytest.fixture(scope="module")
def runtime() -> Iterator[tuple[DocClient, subprocess.Popen[bytes], Path]]:
    home = Path(tempfile.mkdtemp(prefix="corral-contract-", dir="/tmp"))
    tracker = ProcessTracker(home)
    config = yaml.safe_load(Path(json.loads(_default_config_path())).read_text())
    config["agents"]["count"] = 1
    config["heartbeat"] = {"interval_ms": 500, "timeout_s": 20}
    (home / "corral.yaml").write_text(yaml.safe_dump(config))
    (home / "task.yaml").write_text(TASK)
    state = home / ".corral"
    supervisor = tracker.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state),
                                "--config", str(home / "corral.yaml")], name="supervisor")
    ctx: Ctx = zmq.Context()
    try:
        wait_for((state / "keys" / "operator.key").exists, 60, "the keys")
        client = DocClient(ctx, state)
        control = client.dealer("supervisor", "operator")

        def running() -> bool:
            assert supervisor.poll() is None, tracker.output("supervisor")[-3000:]
            try:
                reply = client.ask(control, "status_request", timeout_s=1.0)
            except AssertionError:
                return False
            states = {c["name"]: c["state"] for c in reply["children"]}
            return len(states) >= 5 and set(states.values()) == {"running"}

        wait_for(running, 90, "every child running", interval_s=0.2)
        control.close()
        yield client, supervisor, state
    finally:
        if supervisor.poll() is None:
            supervisor.send_signal(signal.SIGTERM)
        ctx.destroy(linger=0)
        leaked = tracker.cleanup()
        if leaked:
            pytest.fail("processes leaked:\n" + "\n".join(leaked))


def _default_config_path() -> str:
    """The packaged default configuration, found as docs/operations.md says."""
    out = subprocess.run([sys.executable, "-c", "from supervisor.config import "
                          "DEFAULT_CONFIG_PATH as p; import json; print(json.dumps(str(p)))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.strip()


def test_the_writer_serves_every_documented_request(
    runtime: tuple[DocClient, subprocess.Popen[bytes], Path],
) -> None:
    client, _, _ = runtime
    agent = client.dealer("writer", "agent-1")
    try:
        payload = json.dumps({"n": 1}, separators=(",", ":")).encode()
        first = expect(client.ask(agent, "append", origin="agent-1", key="doc-k1",
                                  stream="agent/agent-1", event="doc_note", payload=payload,
                                  ledger=None), "append_ok", duplicate=False)
        expect(client.ask(agent, "append", origin="agent-1", key="doc-k1",
                          stream="agent/agent-1", event="doc_note", payload=payload),
               "append_ok", seq=first["seq"], duplicate=True)
        group = expect(client.ask(agent, "append_many", origin="agent-1",
                                  stream="agent/agent-1", records=[
                                      {"key": "doc-g1", "event": "doc_note", "payload": b"1",
                                       "ledger": None},
                                      {"key": "doc-g2", "event": "doc_note", "payload": b"2"}]),
                       "append_many_ok", count=2, duplicate=False)
        assert group["seq"] > first["seq"] and group["prev_seq"] is not None
        page = expect(client.ask(agent, "read_stream", stream="agent/agent-1",
                                 from_seq=first["seq"]), "records", stream="agent/agent-1")
        seqs = [json.loads(line)["seq"] for line in page["records"]]
        assert first["seq"] in seqs and group["seq"] + 1 in seqs
        expect(client.ask(agent, "ping"), "pong", actor="writer")
        expect(client.ask(agent, "stats_request"), "stats", actor="writer")
        expect(client.ask(agent, "append", origin="agent-2", key="x", stream="agent/agent-2",
                          event="doc_note", payload=b"1"), "error", code="forbidden")
        expect(client.ask(agent, "no_such_kind"), "error", code="unknown_kind")
    finally:
        agent.close()


def test_the_broker_and_procs_serve_every_documented_request(
    runtime: tuple[DocClient, subprocess.Popen[bytes], Path],
) -> None:
    client, _, state = runtime
    # the operator's tools name themselves; procs takes the name `operator` for any session
    tool = client.dealer("broker", "operator", identity=b"operator")
    try:
        expect(client.ask(tool, "ping", to=b"broker"), "pong", actor="broker")
        expect(client.ask(tool, "stats_request", to=b"broker"), "stats", actor="broker")
        expect(client.ask(tool, "ping", to=b"nobody-here"), "error", code="unknown_recipient")
        procs = b"procs"
        # docs/procs.md, The workspace: an idle agent has not made its default one yet
        workspace = state / "agents" / "agent-1" / "workspace"
        workspace.mkdir(parents=True, exist_ok=True)
        cwd = str(workspace)
        common = {"to": procs, "session": "agent-1"}
        out = expect(client.ask(tool, "bash", command="echo doc", cwd=cwd, timeout_s=30.0,
                                max_bytes=1024, max_output_bytes=None, **common),
                     "proc_output", state="exited", exit_code=0)
        assert out["data"] == b"doc\n"
        started = expect(client.ask(tool, "bash_start", command="sleep 60", cwd=cwd,
                                    lifetime_s=120.0, **common), "proc_status", state="running")
        proc_id = started["proc_id"]
        expect(client.ask(tool, "bash_poll", proc_id=proc_id, cursor=0, max_bytes=1024,
                          **common), "proc_output", proc_id=proc_id)
        expect(client.ask(tool, "bash_kill", proc_id=proc_id, **common), "proc_status",
               proc_id=proc_id)
        term = expect(client.ask(tool, "terminal_start", argv=["/bin/cat"], cwd=cwd, rows=24,
                                 cols=80, **common), "proc_status", state="running")
        tid = term["proc_id"]
        expect(client.ask(tool, "terminal_input", proc_id=tid, data=b"hello\n", **common),
               "proc_status", proc_id=tid)

        last: list[dict[str, Any]] = []

        def echoed() -> bool:
            last[:] = [expect(client.ask(tool, "terminal_read", proc_id=tid, cursor=0,
                                         max_bytes=4096, **common), "proc_output", proc_id=tid)]
            return last[0]["next_cursor"] > 0 and len(last[0]["data"]) > 0  # (echo, redacted)

        wait_for(echoed, 30, "the terminal to echo the input", interval_s=0.1)
        expect(client.ask(tool, "terminal_end", proc_id=tid, **common), "proc_status",
               proc_id=tid)
        expect(client.ask(tool, "session_end", **common), "proc_status", proc_id=None)
    finally:
        tool.close()


def test_the_control_socket_serves_every_documented_request(
    runtime: tuple[DocClient, subprocess.Popen[bytes], Path],
) -> None:
    client, supervisor, state = runtime
    agent = client.dealer("supervisor", "agent-1")  # identity unset, as the page says
    operator = client.dealer("supervisor", "operator")
    squatter = client.dealer("supervisor", "operator", identity=b"agent-1")
    try:
        status = expect(client.ask(agent, "status_request"), "status_reply")
        assert status["state_dir"] == str(state)
        expect(client.ask(agent, "ping"), "pong", actor="supervisor")
        expect(client.ask(agent, "stats_request"), "stats", actor="supervisor")
        expect(client.ask(agent, "stop_request", target="agent-1"), "error", code="forbidden")
        # a second connection under a running child's identity is never read
        squatter.send(msgpack.packb({"v": 1, "kind": "ping", "msg_id": "sq"}))
        assert not squatter.poll(500, zmq.POLLIN)

        expect(client.ask(operator, "signal_request", target="agent-1",
                          signal=int(signal.SIGCONT)), "ack", affected=["agent-1"])
        expect(client.ask(operator, "spawn_request", name="doc-spawn", task=None),
               "error", code="invalid_message")
        expect(client.ask(operator, "spawn_request", name="doc-spawn",
                          task=str(state.parent / "task.yaml"), backend="scripted",
                          model=None, replay_stream=None, session=None),
               "ack", affected=["doc-spawn"])
        expect(client.ask(operator, "restart_request", target="agent-1"), "ack",
               affected=["agent-1"])
        expect(client.ask(operator, "stop_request", target="doc-spawn"), "ack")

        def stopped() -> bool:
            reply = client.ask(operator, "status_request")
            states = {c["name"]: c["state"] for c in reply["children"]}
            return states.get("doc-spawn") in ("stopped", "exited")

        wait_for(stopped, 60, "doc-spawn stopped", interval_s=0.2)
        expect(client.ask(operator, "start_request", target="doc-spawn"), "ack")
        expect(client.ask(operator, "stop_request", target="doc-spawn"), "ack")
        wait_for(stopped, 60, "doc-spawn stopped again", interval_s=0.2)
        expect(client.ask(operator, "remove_request", target="doc-spawn"), "ack")
        expect(client.ask(operator, "reload_request"), "reload_reply")
        expect(client.ask(operator, "stop_request", target=None), "ack")
        assert supervisor.wait(timeout=60) == 0  # the whole tree stopped, cleanly
    finally:
        for sock in (agent, operator, squatter):
            sock.close()
