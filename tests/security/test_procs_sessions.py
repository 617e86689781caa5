"""procs acts on a session only for whom it belongs to (actors/procs/ownership.py).

A process holding one agent's credential (an agent process a hostile model
steered, or anything that got hold of the credential) talks to procs through
the broker directly and names another agent's session: it tries to start a
command or a terminal there, read its job's output and its terminal, type into
the terminal, kill the job, end the terminal and the whole session. Each is
refused with `forbidden`, nothing starts (no `proc_start` fact on the victim's
stream, no file in its workspace), and the victim's job and terminal run on.
A subagent child, its parent and the subagents host are held to their part of
the rule the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import pytest

from actors.kernel.settings import AgentSpec, write_spec
from actors.procs import requests
from actors.procs.client import ProcsClient
from actors.procs.ownership import session_refusal
from broker import auth, protocol
from broker.errors import RemoteError
from broker.peer import BrokerPeer
from tests.processes import wait_for
from tests.security.stack import Runtime

VICTIM, MALLORY, CHILD = "victim", "mallory", "victim.c1"


def _outcome(call: Callable[[], object]) -> str:
    """`forbidden` (or another refusal's code), else `served`: what procs did."""
    try:
        call()
    except RemoteError as exc:
        return exc.code
    return "served"


def _facts(rt: Runtime, session: str) -> list[tuple[str, dict[str, object]]]:
    out = []
    for record in rt.writer.read_stream(f"procs/{session}"):
        payload = record.payload()
        assert isinstance(payload, dict)
        out.append((record.event, payload))
    return out


def _workspace(rt: Runtime, session: str) -> Path:
    ws = rt.tmp / f"ws-{session}"
    ws.mkdir()
    write_spec(rt.state, session, AgentSpec(task="unused.yaml", workspace=str(ws)))
    return ws


@pytest.mark.process
def test_a_hostile_agent_cannot_start_read_type_into_or_end_another_agents_jobs(
    runtime: Runtime,
) -> None:
    rt = runtime
    rt.start_procs()
    keyring = auth.ensure_keys(rt.state)
    victim_ws, mallory_ws, child_ws = (_workspace(rt, s) for s in (VICTIM, MALLORY, CHILD))
    peers = {name: BrokerPeer(rt.ctx, rt.state, name, credential=keyring.credential(name))
             for name in (VICTIM, MALLORY, CHILD, auth.SUBAGENTS)}
    try:
        victim = ProcsClient(peers[VICTIM], VICTIM)
        job = victim.start("while :; do echo tick; sleep 0.05; done", str(victim_ws))
        term = victim.terminal_start(["tr", "a-z", "A-Z"], str(victim_ws))
        victim.terminal_input(term.proc_id, b"victim-typed\n")
        before = _facts(rt, VICTIM)

        hostile = ProcsClient(peers[MALLORY], VICTIM)  # mallory's credential, victim's session
        victim_cwd = str(victim_ws)
        attempts: dict[str, Callable[[], object]] = {
            "bash": lambda: hostile.bash("touch pwned-bash", victim_cwd, timeout_s=5),
            "bash_start": lambda: hostile.start("touch pwned-start", victim_cwd),
            "terminal_start": lambda: hostile.terminal_start(
                ["/bin/sh", "-c", "touch pwned-term"], victim_cwd),
            "bash_poll": lambda: hostile.poll(job.proc_id),
            "terminal_read": lambda: hostile.terminal_read(term.proc_id),
            "terminal_input": lambda: hostile.terminal_input(term.proc_id, b"mallory-typed\n"),
            "bash_kill": lambda: hostile.kill(job.proc_id),
            "terminal_end": lambda: hostile.terminal_end(term.proc_id),
            "session_end": hostile.end_session,
        }
        outcomes = {kind: _outcome(call) for kind, call in attempts.items()}
        assert outcomes == dict.fromkeys(attempts, "forbidden")

        # nothing started, typed, killed or ended on the victim's stream or workspace
        assert _facts(rt, VICTIM) == before
        assert [e for e, _ in before].count("proc_start") == 1
        assert sorted(p.name for p in victim_ws.iterdir()) == []
        # the victim's job and terminal run on, and are still its own to use
        polled = victim.poll(job.proc_id)
        assert polled.state == "running"
        wait_for(lambda: victim.poll(job.proc_id, cursor=polled.next_cursor).data, 30,
                 "the victim's job to go on writing")
        seen = bytearray()

        def echoed() -> bool:
            seen.extend(victim.terminal_read(term.proc_id, len(seen)).data)
            return b"VICTIM-TYPED" in seen

        wait_for(echoed, 30, "the victim's terminal to answer its own input")
        assert b"MALLORY" not in seen
        assert victim.terminal_read(term.proc_id, len(seen)).state == "running"

        # a child is not its parent, nor the parent its child; the subagents host
        # only ends a child's session
        child = ProcsClient(peers[CHILD], CHILD)
        assert _outcome(lambda: ProcsClient(peers[CHILD], VICTIM).poll(job.proc_id)) == \
            "forbidden"
        child_job = child.start("sleep 60", str(child_ws))
        assert _outcome(lambda: ProcsClient(peers[VICTIM], CHILD).kill(child_job.proc_id)) == \
            "forbidden"
        host = {s: ProcsClient(peers[auth.SUBAGENTS], s) for s in (VICTIM, CHILD)}
        assert _outcome(lambda: host[CHILD].start("touch pwned-host", str(child_ws))) == \
            "forbidden"
        assert _outcome(host[VICTIM].end_session) == "forbidden"
        assert victim.poll(job.proc_id).state == "running"
        assert host[CHILD].end_session().ended == 1  # the host's one job: end a child
        assert child.poll(child_job.proc_id).state == "killed"
        assert sorted(p.name for p in child_ws.iterdir()) == []

        # mallory's own session is served (the refusals above are about ownership)
        own = ProcsClient(peers[MALLORY], MALLORY).bash("echo mine", str(mallory_ws))
        assert (own.data, own.exit_code) == (b"mine\n", 0)
        # one line per refused request: a request resent after a client timeout (a
        # stall under load) is logged again under the same msg_id, so count msg_ids
        lines = rt.state.log_path("procs").read_text().splitlines()
        refused = [r for r in map(json.loads, (ln for ln in lines if ln.startswith("{")))
                   if r.get("event") == "session_refused"]
        assert len({r["msg_id"] for r in refused}) == len(attempts) + 4
        assert {r["kind"] for r in refused
                if (r["sender"], r["session"]) == (MALLORY, VICTIM)} == set(attempts)
        assert victim.end_session().ended == 2
    finally:
        for peer in peers.values():
            peer.close()


# requests that name a session but go to another actor, never to procs: the
# supervisor's spawn request names the session an adopted agent resumes (fleet)
NOT_FOR_PROCS = {protocol.SpawnRequest}


def test_the_session_rule() -> None:
    allowed = [("agent-1", "agent-1", "bash"), ("agent-1.c", "agent-1.c", "terminal_input"),
               ("automation", "automation", "bash"), ("operator", "agent-2", "bash_kill"),
               ("subagents", "agent-1.c", "session_end"), ("agent-1", "agent-1.pl-4.0", "bash")]
    refused = [("agent-1", "agent-2", "bash_poll"), ("agent-1", "agent-1.c", "bash_kill"),
               ("agent-1.c", "agent-1", "terminal_read"), ("agent-1.c", "agent-1.d", "bash"),
               ("subagents", "agent-1", "session_end"), ("subagents", "agent-1.c", "bash"),
               ("subagents", "subagents.x", "bash_start"), ("procs", "agent-1", "bash"),
               ("automation", "agent-1", "bash"), ("agent-1", "operator", "bash"),
               ("agent-1", "agent-2.pl-4.0", "bash"), ("agent-1.c", "agent-1.pl-4.0", "bash"),
               ("agent-1.pl-4.0", "agent-1", "bash"), ("subagents", "subagents.pl-1", "bash")]
    assert [session_refusal(*case) for case in allowed] == [None] * len(allowed)
    assert all(session_refusal(*case) for case in refused)
    # every request naming a session is one procs checks: a new one must be added
    with_session = {m for m in get_args(get_args(protocol.Message)[0])
                    if "session" in m.model_fields
                    and m.model_fields["kind"].default in protocol.REQUEST_KINDS
                    and m not in NOT_FOR_PROCS}
    assert with_session == set(get_args(requests.Request))
