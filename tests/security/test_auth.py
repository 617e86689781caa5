"""Authenticated actors (broker/auth.py): a same-uid process that can reach the
runtime's sockets, with no credential or with one agent's, cannot append to
another actor's stream, append an operator fact, append under the origin of a
runtime role, take another actor's name at the broker, or send a mutating
control command to the supervisor; the operator's CLI and every actor's own
traffic still work, and no credential is in any child's argv or environment."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
from zmq.utils.monitor import recv_monitor_message

from actors.sessions.rebuild import rebuild
from actors.writer.client import WriterClient
from broker import auth, protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.requester import new_msg_id
from broker.statedir import StateDir
from tests.processes import ProcessTracker, wait_for
from tests.test_writer import start_writer

pytestmark = pytest.mark.process

Ctx = zmq.Context[zmq.Socket[bytes]]
ANSWER = json.dumps({"request": "req-1.0", "decision": "approve", "always": True,
                     "note": None, "op": "write_file", "pattern": "release/*"},
                    separators=(",", ":")).encode()


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def forged(event: str, stream: str, origin: str, key: str,
           payload: bytes = b"{}") -> protocol.Append:
    ledger: Any = {"approval_answer": "approvals", "budget_resumed": "budget"}.get(event)
    return protocol.Append(msg_id=new_msg_id("f"), origin=origin, key=key, stream=stream,
                           event=event, payload=payload, ledger=ledger)


def raw_ask(ctx: Ctx, endpoint: str, message: protocol.Message, timeout_ms: int = 1000,
            credential: auth.Credential | None = None) -> bytes | None:
    """One request on a DEALER of our own; the reply frame, or None if none came."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if credential is not None:
        auth.apply_client(sock, credential)
    sock.connect(endpoint)
    try:
        sock.send(protocol.encode(message), zmq.NOBLOCK)
        return sock.recv() if sock.poll(timeout_ms) else None
    except zmq.Again:
        return None
    finally:
        sock.close(linger=0)


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_refused(ctx: Ctx, endpoint: str, frames: list[bytes],
                      credential: auth.Credential | None = None, *,
                      identity: bytes | None = None, timeout_s: float = 30.0) -> int:
    """Send `frames` on a DEALER of our own that connects once (no reconnect) and
    return the HANDSHAKE_FAILED_* event the server's refusal caused. ZeroMQ holds
    the frames until a handshake succeeds, so a failed one on the only connection
    proves they were never delivered (closing drops them). No answer within a
    deadline proved nothing: a server stalled past it under load, then accepting,
    would have passed."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection, one verdict
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if credential is not None:
        auth.apply_client(sock, credential)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        # zmq.Again: the one connection already failed its handshake and took its
        # pipe with it (the refusal came before the send, under load): nothing was
        # sent, and the verdict is still the monitor's to give
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(frames, zmq.NOBLOCK)
        assert monitor.poll(int(timeout_s * 1000)), f"no handshake verdict from {endpoint}"
        event = int(recv_monitor_message(monitor)["event"])
        assert event & HANDSHAKE_FAILED, f"handshake accepted: {zmq.Event(event)!r}"
        assert not sock.poll(0), "answered"
        return event
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def stream(reader: WriterClient, name: str) -> list[tuple[str, str]]:
    return [(r.event, r.key) for r in reader.read_stream(name)]


def test_writer_refuses_forged_appends_without_or_with_an_agents_credential(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    writer = start_writer(processes, state_dir, ctx)
    keyring = auth.ensure_keys(state_dir)
    endpoint = state_dir.endpoint("writer")
    # no credential at all, and a wrong password for agent-1: the handshake fails
    # (the ZAP handler denies the wrong password; a client without one speaks the
    # wrong mechanism), so nothing reaches the writer
    wrong = auth.Credential("agent-1", b"0" * 64)
    for credential in (None, wrong):
        for message in (
            forged("approval_answer", "agent/agent-2", "operator", "n1", ANSWER),
            forged("turn", "agent/agent-2", "agent-2", "n2"),
        ):
            failed = handshake_refused(ctx, endpoint, [protocol.encode(message)], credential)
            if credential is wrong:
                assert failed == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # agent-1's own credential: typed refusals, nothing written
    # one try each (a refusal is the answer), given 10 s: a writer stalled 2 s under
    # load timed the refusal out
    agent = WriterClient(ctx, state_dir, "agent-1", credential=keyring.credential("agent-1"),
                         timeout_s=10, retries=0)
    refused = [
        ("agent/agent-2", "turn", "agent-2"),  # another agent's stream
        ("agent/agent-2", "approval_answer", "operator"),  # an operator fact, elsewhere
        ("agent/agent-1", "approval_answer", "agent-1"),  # ... or on its own stream
        ("agent/agent-1", "budget_resumed", "agent-1"),
        ("agent/agent-1", "turn", "supervisor"),  # a role's origin on its own stream
        ("agent/agent-1", "turn", "operator"),
        ("procs/agent-1", "proc_start", "procs/agent-1"),  # the streams procs serves
        ("subagents/agent-1", "subagent_spawned", "subagents"),
    ]
    for i, (name, event, origin) in enumerate(refused):
        with pytest.raises(RemoteError) as caught:
            agent.append(name, event, ANSWER, key=f"x{i}", origin=origin)
        assert caught.value.code == "forbidden", (name, event, origin)
    # what each actor may do still works
    assert agent.append("agent/agent-1", "turn", {"n": 1}, key="own").seq == 1
    procs = WriterClient(ctx, state_dir, "procs", credential=keyring.credential("procs"))
    assert procs.append("procs/agent-1", "proc_start", {}, key="p1",
                        origin="procs/agent-1").seq == 2
    with pytest.raises(RemoteError, match="may not append"):
        procs.append("agent/agent-1", "turn", {}, key="p2", origin="procs/agent-1")
    operator = WriterClient(ctx, state_dir, "operator",
                            credential=auth.operator_credential(state_dir))
    assert operator.append("agent/agent-2", "approval_answer", ANSWER, key="op1",
                           ledger="approvals").seq == 3
    assert stream(operator, "agent/agent-2") == [("approval_answer", "op1")]
    assert stream(operator, "agent/agent-1") == [("turn", "own")]
    assert writer.poll() is None
    for client in (agent, procs, operator):
        client.close()


def test_broker_takes_a_name_only_from_the_actor_it_authenticates(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx
) -> None:
    processes.spawn(["-m", "broker.server", "--state-dir", str(state_dir.root)], name="broker")
    keyring = auth.ensure_keys(state_dir)
    procs = BrokerPeer(ctx, state_dir, "procs", credential=keyring.credential("procs"))
    wait_for(lambda: _pong(procs), 30, "the broker")
    # agent-1's credential under the name procs (or another agent's ZMQ identity): refused,
    # and the real procs keeps its traffic (no takeover of its routing)
    for name in (b"procs", b"agent-2"):
        impostor = ctx.socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.setsockopt(zmq.IDENTITY, name)
        auth.apply_client(impostor, keyring.credential("agent-1"))
        impostor.connect(state_dir.endpoint("broker"))
        for to in (b"broker", b"agent-1"):  # register / route: both refused
            impostor.send_multipart([to, protocol.encode(protocol.Ping(msg_id="imp"))])
            assert impostor.poll(30_000)
            sender, frame = impostor.recv_multipart()
            error = protocol.decode(frame)
            assert sender == b"broker" and isinstance(error, protocol.Error)
            assert error.code == "forbidden"
        impostor.close()
    with pytest.raises(auth.AuthError):
        BrokerPeer(ctx, state_dir, "procs", credential=keyring.credential("agent-1"))
    # no credential: the connection never gets through (its handshake fails)
    raw = protocol.encode(protocol.Ping(msg_id="nocred"))
    handshake_refused(ctx, state_dir.endpoint("broker"), [b"broker", raw], identity=b"procs")
    # the real procs still answers, and an agent under its own name is routed
    agent = BrokerPeer(ctx, state_dir, "agent-1", credential=keyring.credential("agent-1"))
    wait_for(lambda: _pong(agent), 30, "the broker to answer agent-1")
    agent.send("procs", protocol.Ping(msg_id="to-procs"))
    got = wait_for(lambda: procs.recv(0.05), 30, "the routed ping")
    assert got[0] == "agent-1" and got[1].msg_id == "to-procs"
    stats = procs.request("broker", protocol.StatsRequest(msg_id="st"), timeout_s=2)
    assert isinstance(stats, protocol.Stats)
    assert stats.values["routed_total"] == 1  # nothing the impostors sent was routed
    agent.close()
    procs.close()


def _pong(peer: BrokerPeer) -> bool:
    try:
        reply = peer.request("broker", protocol.Ping(msg_id=new_msg_id("p")), timeout_s=0.3,
                             retries=0)
    except (RequestTimeoutError, RemoteError):
        return False
    return isinstance(reply, protocol.Pong)


# --- the whole runtime: a scripted agent's bash tries the forgeries ----------------
# Each try prints a verdict that is positive either way: "unreachable <errno>" (the
# socket cannot even be connected to: the sandbox hides the state directory),
# "handshake-refused" (no credential: the server failed the handshake on the only
# connection, so ZeroMQ never delivered the request), or "answered" /
# "accepted-no-answer". Before, no answer within 500 ms counted as refused: a
# server stalled past that under load, then accepting, would have passed.
FORGE = """\
import errno, socket, sys, zmq
from zmq.utils.monitor import recv_monitor_message
from broker import protocol
endpoints, ctx = dict(zip(("writer", "supervisor"), sys.argv[1:3])), zmq.Context()
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
def verdict(endpoint, message):
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(endpoint.removeprefix("ipc://"))
    except OSError as exc:
        return "unreachable " + errno.errorcode.get(exc.errno, str(exc.errno))
    finally:
        probe.close()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, -1)
    monitor = s.get_monitor_socket(FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    s.connect(endpoint)
    s.send(protocol.encode(message), zmq.NOBLOCK)
    if not monitor.poll(30000):
        return "no-verdict"
    if int(recv_monitor_message(monitor)["event"]) & FAILED:
        return "handshake-refused"
    return "answered" if s.poll(30000) else "accepted-no-answer"
def ask(name, message):
    print(name, message.kind, verdict(endpoints[name], message), flush=True)
ask("writer", protocol.Append(msg_id="f1", origin="operator", key="forged-answer",
    stream="agent/agent-2", event="approval_answer", ledger="approvals",
    payload=ANSWER))
ask("writer", protocol.Append(msg_id="f2", origin="operator", key="forged-resume",
    stream="agent/agent-2", event="budget_resumed", ledger="budget",
    payload=b'{"tokens":1000000,"cost_units":1000,"segment":0}'))
ask("supervisor", protocol.SignalRequest(msg_id="k1", target="agent-2", signal=9))
print("forge-done")
"""


def _config(state_dir: StateDir) -> Path:
    fast = {"backoff": {"base_s": 0.05, "cap_s": 0.2, "jitter": 0.0},
            "intensity": {"max_restarts": 5, "period_s": 30}, "shutdown_timeout_s": 3}
    config = {
        "heartbeat": {"interval_ms": 200, "timeout_s": 10},
        "status_interval_s": 0.2,
        "children": [{"name": "writer", "kind": "writer", **fast},
                     {"name": "broker", "kind": "broker", **fast},
                     {"name": "procs", "kind": "procs", **fast}],
        "agents": {"count": 0, **fast},
        "agent": {"approval_poll_ms": 50, "permissions": {"default": "allow", "rules": [
            {"op": "write_file", "path": "release/*", "decision": "ask"}]}},
    }
    path = state_dir.root.parent / "auth.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _task(path: Path, steps: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "steps": steps}))
    return path


def _cli(processes: ProcessTracker, state_dir: StateDir, *args: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args, "--state-dir", str(state_dir.root)],
        env=processes.env(), capture_output=True, text=True, timeout=30, check=False)


def _children(processes: ProcessTracker, state_dir: StateDir) -> dict[str, dict[str, Any]]:
    done = _cli(processes, state_dir, "status", "--json")
    assert done.returncode == 0, done.stderr
    return {c["name"]: c for c in json.loads(done.stdout)["children"]}


@pytest.mark.timeout(120)
def test_a_scripted_agents_bash_cannot_forge_answers_or_kill_and_the_operator_can(
    processes: ProcessTracker, state_dir: StateDir, ctx: Ctx, tmp_path: Path
) -> None:
    config = _config(state_dir)
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(config)], name="up")
    wait_for(lambda: state_dir.status_path.exists() or up.poll() is not None, 30, "the status")
    assert up.poll() is None, processes.output("up")
    key_file = auth.keys_dir(state_dir) / "operator.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    victim = _task(tmp_path / "victim.yaml", [
        {"op": "write_file", "path": "release/notes.md", "content": "v1"},
        {"op": "finish", "summary": "released"}])
    script = FORGE.replace("payload=ANSWER", f"payload={ANSWER!r}")
    attacker = _task(tmp_path / "attacker.yaml", [
        {"op": "write_file", "path": "forge.py", "content": script},
        {"op": "bash", "command": f"{sys.executable} forge.py "
                                  f"{state_dir.endpoint('writer')} "
                                  f"{state_dir.endpoint('supervisor')}"},
        {"op": "finish", "summary": "tried"}])
    operator = WriterClient(ctx, state_dir, "operator")

    def pending() -> list[Any]:
        return rebuild(operator, state_dir, "agent-2").state.pending_approvals()

    try:
        done = _cli(processes, state_dir, "spawn", "agent-2", "--task", str(victim))
        assert done.returncode == 0, done.stderr
        [request] = wait_for(pending, 30, "agent-2's approval request")
        assert request.request == "req-1.0"
        _no_secret_in_argv_or_env(state_dir)
        victim_pid = _children(processes, state_dir)["agent-2"]["pid"]
        done = _cli(processes, state_dir, "spawn", "agent-1", "--task", str(attacker))
        assert done.returncode == 0, done.stderr

        def finished() -> bool:
            return rebuild(operator, state_dir, "agent-1").state.phase == "finished"

        wait_for(finished, 60, "the attacker's task to finish")
        results = [r.payload() for r in operator.read_stream("agent/agent-1")
                   if r.event == "tool_result"]
        [output] = [p["result"]["output"] for p in results  # type: ignore[index]
                    if p["op"] == "bash"]  # type: ignore[index]
        # the bash ran the forgery to its end, and each try was positively refused:
        # no socket at all (the sandbox), or no handshake (authentication)
        *tries, last = output.splitlines()
        assert last == "forge-done", output
        assert [t.split()[:2] for t in tries] == [
            ["writer", "append"], ["writer", "append"], ["supervisor", "signal_request"]], output
        assert all(t.split()[2] in ("unreachable", "handshake-refused") for t in tries), output
        for endpoint in (state_dir.endpoint("writer"), state_dir.endpoint("supervisor")):
            _connectable(endpoint)  # the paths the forgery tried are the runtime's sockets
        # nothing forged is in the WAL; the approval is still pending; agent-2 lives
        events = stream(operator, "agent/agent-2")
        assert not any(e in auth.OPERATOR_EVENTS for e, _ in events), events
        assert [r.request for r in pending()] == ["req-1.0"]
        child = _children(processes, state_dir)["agent-2"]
        assert (child["pid"], child["state"]) == (victim_pid, "running")
        # the operator's CLI (it reads keys/operator.key) answers; agent-2 goes on
        done = _cli(processes, state_dir, "approve", "agent-2", "req-1.0")
        assert done.returncode == 0, done.stderr
        notes = state_dir.agent_dir("agent-2") / "workspace" / "release" / "notes.md"
        wait_for(notes.exists, 30, "agent-2 to write after the answer")
        # a mutating control command with agent-1's credential: refused, nobody dies
        # (answers are waited for 30 s: 1 s lost to a supervisor stalled under load)
        reply = raw_ask(ctx, state_dir.endpoint("supervisor"), protocol.SignalRequest(
            msg_id="k2", target="procs", signal=9), timeout_ms=30_000,
            credential=auth.ensure_keys(state_dir).credential("agent-1"))
        assert reply is not None
        refusal = protocol.decode(reply)
        assert isinstance(refusal, protocol.Error) and refusal.code == "forbidden"
        status = raw_ask(ctx, state_dir.endpoint("supervisor"), protocol.StatusRequest(
            msg_id="s1"), timeout_ms=30_000,
            credential=auth.ensure_keys(state_dir).credential("agent-1"))
        assert status is not None and isinstance(protocol.decode(status), protocol.StatusReply)
        # no credential: the handshake fails, so the stop never reaches the supervisor
        handshake_refused(ctx, state_dir.endpoint("supervisor"),
                          [protocol.encode(protocol.StopRequest(msg_id="s2"))])
        procs = _children(processes, state_dir)["procs"]
        assert procs["state"] == "running" and procs["restarts"] == 0
    finally:
        operator.close()
        _cli(processes, state_dir, "stop", "--timeout-s", "20")
    assert up.wait(timeout=30) == 0


def _connectable(endpoint: str) -> None:
    """A unix socket is listening at the path of `endpoint` (ipc://PATH)."""
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(endpoint.removeprefix("ipc://"))
    finally:
        probe.close()


def _no_secret_in_argv_or_env(state_dir: StateDir) -> None:
    """No child of the runtime carries a password in its argv or environment."""
    keyring = auth.ensure_keys(state_dir)
    secrets = [keyring.password(n) for n in ("writer", "broker", "procs", "agent-1",
                                              "agent-2", "operator")]
    def running() -> list[int] | None:
        status = json.loads(state_dir.status_path.read_text())
        pids = [c["pid"] for c in status["children"] if c.get("pid")]
        return pids if len(pids) >= 4 else None  # writer, broker, procs, agent-2

    pids: list[int] = wait_for(running, 30, "the status file to list every child")
    for pid in pids:
        for name in ("cmdline", "environ"):
            data = Path(f"/proc/{pid}/{name}").read_bytes()
            assert not any(s in data for s in secrets), (pid, name)


def test_credentials_and_policy_units(state_dir: StateDir) -> None:
    keyring = auth.ensure_keys(state_dir)
    operator = auth.operator_credential(state_dir)
    assert operator.name == "operator" and keyring.verify("operator", operator.secret)
    assert "secret" not in repr(operator) and operator.secret.decode() not in repr(operator)
    assert auth.Credential.decode(keyring.credential("subagents").encode()).mint is not None
    sub = keyring.credential("subagents")
    child = sub.child("agent-1.c1")
    assert keyring.verify("agent-1.c1", child.secret)
    with pytest.raises(auth.AuthError):
        sub.child("agent-1")  # the subagents host cannot mint an undotted actor
    with pytest.raises(auth.AuthError):
        keyring.credential("agent-1").child("agent-1.c1")
    assert not keyring.verify("agent-1", keyring.password("agent-2"))
    assert auth.append_refusal("agent-1.c1", "agent/agent-1.c1", "agent-1.c1", "turn") is None
    assert auth.append_refusal("agent-1.c1", "agent/agent-1", "agent-1.c1", "turn")
    assert auth.append_refusal("operator", "agent/x", "operator", "approval_answer") is None
    for role in ("procs", "subagents", "writer"):
        assert auth.append_refusal(role, f"agent/{role}", role, "turn")  # roles are not agents
    assert auth.control_refusal("agent-1", "signal_request")
    assert auth.control_refusal("agent-1", "status_request") is None
    fd = auth.credential_pipe(keyring.credential("agent-3"))
    assert auth.read_credential(fd) == keyring.credential("agent-3")
    with pytest.raises(OSError):
        os.fstat(fd)  # read and closed

