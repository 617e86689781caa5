"""A real runtime for the security tests: writer, broker and procs started as
processes on a temporary state directory, and real agents (`python -m
actors.agent`) that play a scripted task of documented ops against it, the
way a hostile model would drive them. Every process gets the model's key in
its environment (as the supervisor used to hand it down), so a test can show
where it does not go."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from actors.kernel.settings import AgentSettings, AgentSpec, write_spec
from actors.writer.client import WriterClient
from broker import protocol
from broker.errors import RemoteError, RequestTimeoutError
from broker.peer import BrokerPeer
from broker.statedir import StateDir
from tests.agentkit import write_task
from tests.processes import ProcessTracker, wait_for

MODEL_KEY = "sk-corral-test-model-key-4f1d"
KEY_ENV = {"OPENAI_API_KEY": MODEL_KEY}


@dataclass
class Runtime:
    state: StateDir
    processes: ProcessTracker
    tmp: Path
    ctx: zmq.Context[zmq.Socket[bytes]]
    writer: WriterClient
    peer: BrokerPeer
    procs_runs: int = 0
    procs: subprocess.Popen[bytes] | None = None

    @property
    def root(self) -> str:
        return str(self.state.root)

    def start_procs(self, *args: str) -> None:
        self.procs_runs += 1
        self.procs = self.processes.spawn(
            ["-m", "actors.procs", "--state-dir", self.root, "--kill-grace-s", "0.3", *args],
            name=f"procs{self.procs_runs}", env=dict(KEY_ENV))
        wait_for(self._procs_answers, 30, "procs to answer a ping")

    def _procs_answers(self) -> bool:
        try:
            reply = self.peer.request("procs", protocol.Ping(msg_id=f"w{time.monotonic_ns()}"),
                                      timeout_s=0.2, retries=0)
        except (RequestTimeoutError, RemoteError):
            return False
        return isinstance(reply, protocol.Pong)

    def stop_procs(self) -> None:
        """Stop the procs `start_procs` started last (not whatever process was
        started last: an agent run since would be stopped instead, and two
        procs would then answer)."""
        assert self.procs is not None, "no procs started"
        self.procs.terminate()
        self.procs.wait(30)
        self.procs = None

    def start_agent(self, name: str, steps: list[dict[str, Any]], *,
                    workspace: Path | None = None,
                    **settings: Any) -> subprocess.Popen[bytes]:
        """Start a real agent playing `steps` (one action per turn: call ids
        "1.0", "2.0", ...)."""
        task = write_task(self.tmp / f"{name}.yaml", steps)
        write_spec(self.state, name, AgentSpec(
            task=str(task), workspace=str(workspace) if workspace is not None else None,
            settings=AgentSettings(**settings)))
        return self.processes.spawn(["-m", "actors.agent", "--name", name,
                                     "--state-dir", self.root], name=name, env=dict(KEY_ENV))

    def finish_agent(self, name: str, agent: subprocess.Popen[bytes]) -> dict[str, Any]:
        """Wait for the agent's session to end; its tool results by call id."""
        assert agent.wait(90) == 0, self.processes.output(name)
        return self.results(name)

    def run_agent(self, name: str, steps: list[dict[str, Any]], *,
                  workspace: Path | None = None, **settings: Any) -> dict[str, Any]:
        """Play `steps` to the end; return the tool results by call id."""
        return self.finish_agent(name, self.start_agent(name, steps, workspace=workspace,
                                                        **settings))

    def results(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for record in self.writer.read_stream(f"agent/{name}"):
            payload = record.payload()
            if record.event == "tool_result" and isinstance(payload, dict):
                out[str(payload["call_id"])] = payload["result"]
        return out

    def files_holding(self, needle: bytes) -> list[str]:
        """Every file under the state directory (WAL, ledgers, logs, job logs,
        vaults, specs) that holds `needle`."""
        found = []
        for path in self.state.root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    if needle in path.read_bytes():
                        found.append(str(path.relative_to(self.state.root)))
                except OSError:
                    continue
        return found


def _start_core(rt: Runtime) -> None:
    for module, name in (("actors.writer", "writer"), ("broker.server", "broker")):
        rt.processes.spawn(["-m", module, "--state-dir", rt.root], name=name, env=dict(KEY_ENV))


@pytest.fixture
def runtime(processes: ProcessTracker, state_dir: StateDir, tmp_path: Path) -> Iterator[Runtime]:
    """writer and broker on a fresh state dir; the test starts procs its way."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rt = Runtime(state_dir, processes, tmp_path, ctx, WriterClient(ctx, state_dir, "test"),
                 BrokerPeer(ctx, state_dir, "probe"))
    _start_core(rt)
    try:
        yield rt
    finally:
        rt.peer.close()
        rt.writer.close()
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def shared() -> Iterator[Runtime]:
    """One runtime for a module's tests (writer, broker, and procs with the
    sandbox on and the network open to sessions named `net-*`): each test
    uses agents and directories of its own. Leaks fail the module."""
    yield from module_runtime("--sandbox-network", "net-*")


def module_runtime(*procs_args: str) -> Iterator[Runtime]:
    """The body of a module-scoped runtime fixture whose procs takes `procs_args`."""
    root = Path(tempfile.mkdtemp(prefix="corral-", dir="/tmp"))
    state = StateDir(root / ".corral").ensure()
    processes = ProcessTracker(root)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rt = Runtime(state, processes, root, ctx, WriterClient(ctx, state, "test"),
                 BrokerPeer(ctx, state, "probe"))
    try:
        _start_core(rt)
        rt.start_procs(*procs_args)
        yield rt
    finally:
        rt.peer.close()
        rt.writer.close()
        ctx.destroy(linger=0)
        leaked = processes.cleanup()
        shutil.rmtree(root, ignore_errors=True)
        if leaked:
            pytest.fail("processes leaked by the tests:\n" + "\n".join(leaked))


def output_of(result: Any) -> str:
    assert isinstance(result, dict), result
    return str(result.get("output", result.get("error", "")))


def host_pids_running(argv_tail: list[str]) -> list[int]:
    """Pids of live processes whose argv ends with `argv_tail`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and \
                    proc.info["cmdline"][-len(argv_tail):] == argv_tail:
                found.append(proc.pid)
        except (psutil.Error, TypeError):
            continue
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            continue
