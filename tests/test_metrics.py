"""The supervisor's Prometheus endpoint: off unless configured, loopback only;
a real runtime with `metrics.listen` on port 0 is scraped over HTTP and the
exposition parsed with prometheus_client's parser: the writer's appends and
fsync histogram after work, an agent's turns and calls, every child's state
and heartbeat age, and a child's restart count after a SIGKILL."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker.errors import ConfigError
from broker.statedir import StateDir
from supervisor import config as config_mod
from supervisor.runtime.metrics import ConfigError as ListenError
from supervisor.runtime.metrics import parse_listen
from tests.agentkit import write_task
from tests.processes import ProcessTracker, wait_for
from tests.test_supervisor_process import children, cli
from tests.test_supervisor_run import fast_config


def _default() -> dict[str, object]:
    data: dict[str, object] = yaml.safe_load(config_mod.DEFAULT_CONFIG_PATH.read_text())
    return data


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "10.1.2.3:9464", "example.com:80",
                                    "9464", "127.0.0.1:99999", "127.0.0.1:http"])
def test_only_a_loopback_host_port_is_accepted(listen: str) -> None:
    with pytest.raises(ListenError):
        parse_listen(listen)
    with pytest.raises(ConfigError, match="metrics"):
        config_mod.parse({**_default(), "metrics": {"listen": listen}}, "test.yaml")


def test_loopback_addresses_parse() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("localhost:9464") == ("localhost", 9464)
    assert config_mod.parse(_default(), "test.yaml").metrics.listen is None  # off by default
    on = config_mod.parse({**_default(), "metrics": {"listen": "127.0.0.1:0"}}, "test.yaml")
    assert on.metrics.listen == "127.0.0.1:0"


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} from one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]], metric: str,
          **labels: str) -> float | None:
    return metrics.get(metric, {}).get(tuple(sorted(labels.items())))


@pytest.mark.process
@pytest.mark.timeout(120)
def test_scrape_a_running_runtime(processes: ProcessTracker, state_dir: StateDir,
                                  tmp_path: Path) -> None:
    path = fast_config(state_dir)
    config = yaml.safe_load(path.read_text())
    config["metrics"] = {"listen": "127.0.0.1:0"}
    config["agents"]["count"] = 1
    path.write_text(yaml.safe_dump(config))
    up = processes.spawn(["-m", "supervisor.cli", "up", "--state-dir", str(state_dir.root),
                          "--config", str(path)], name="up")
    port_file = state_dir.run_dir / "metrics.port"
    wait_for(lambda: up.poll() is None and port_file.exists(), 30, "run/metrics.port")
    port = int(port_file.read_text())
    wait_for(lambda: all(c["state"] == "running" for c in children(processes, state_dir).values()),
             60, "every child running")
    task = write_task(tmp_path / "work.yaml", [
        {"op": "write_file", "path": "a.txt", "content": "a\n"},
        {"op": "write_file", "path": "b.txt"},  # rejected
        {"op": "finish", "summary": "done"},
    ])
    assert cli(processes, state_dir, "spawn", "worker", "--task", str(task)).returncode == 0

    def worked() -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
        m = scrape(port)
        turns = value(m, "corral_agent_turns_total", name="worker", kind="agent")
        appends = value(m, "corral_writer_appends_total", name="writer", kind="writer")
        # the writer reports with its own heartbeat: wait for one after the work;
        # procs' counters come with its first heartbeat after its loop has run
        live = value(m, "corral_procs_live_commands", name="procs", kind="procs")
        return m if (turns is not None and turns >= 3 and (appends or 0) >= turns
                     and live is not None) else None

    m = wait_for(worked, 60, "the worker's turns, the writer's appends and procs' counters")
    w = {"name": "writer", "kind": "writer"}
    appends = value(m, "corral_writer_appends_total", **w)
    assert appends is not None and appends > 0
    fsyncs = value(m, "corral_writer_fsync_seconds_count", **w)
    assert fsyncs is not None and fsyncs > 0
    assert value(m, "corral_writer_fsync_seconds_bucket", **w, le="+Inf") == fsyncs
    batches = value(m, "corral_writer_batch_records_count", **w)
    assert batches == value(m, "corral_writer_batches_total", **w)
    assert value(m, "corral_writer_batch_records_sum", **w) == appends
    assert value(m, "corral_writer_lane_connections", **w) is not None  # the local lane
    assert value(m, "corral_writer_lane_refused_total", **w) == 0
    worker = {"name": "worker", "kind": "agent"}
    calls = value(m, "corral_agent_calls_total", **worker)
    assert calls is not None and calls >= 3
    assert value(m, "corral_agent_rejects_total", **worker) == 1
    tokens = value(m, "corral_agent_budget_tokens_used", **worker)
    assert tokens is not None and tokens > 0
    for name in ("writer", "broker", "procs", "subagents", "agent-1"):
        kind = "agent" if name == "agent-1" else name
        assert value(m, "corral_child_state", name=name, kind=kind, state="running") == 1
        age = value(m, "corral_child_heartbeat_age_seconds", name=name, kind=kind)
        assert age is not None and age < 10
        rss = value(m, "corral_child_rss_bytes", name=name, kind=kind)
        assert rss is not None and rss > 0
    assert value(m, "corral_procs_live_commands", name="procs", kind="procs") == 0
    assert "corral_broker_routed_total" in m and "corral_broker_refused_total" in m
    assert value(m, "corral_child_restarts_total", name="agent-1", kind="agent") == 0

    pid = children(processes, state_dir)["agent-1"]["pid"]
    done = cli(processes, state_dir, "kill", "agent-1", "--signal", str(int(signal.SIGKILL)))
    assert done.returncode == 0, done.stderr

    def restarted() -> bool:
        m = scrape(port)
        return value(m, "corral_child_restarts_total", name="agent-1", kind="agent") == 1 \
            and children(processes, state_dir)["agent-1"]["pid"] not in (None, pid)

    wait_for(restarted, 60, "agent-1's restart in the scrape")
    assert cli(processes, state_dir, "stop").returncode == 0
    assert not port_file.exists()
