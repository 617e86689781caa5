"""The zygote's `run` request (a writer or broker restarted as a fork): only
the modules the zygote preloads can be asked for, with a list of string args."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actors import zygote


def test_run_request_round_trips_and_names_only_preloaded_modules() -> None:
    data = zygote.run_request("writer", "actors.writer", ["--state-dir", "/tmp/a b/.corral"])
    assert zygote.parse_request(data) == zygote.ForkRequest(
        "writer", None, False, "actors.writer", ("--state-dir", "/tmp/a b/.corral"))
    # with its credential pipe and the model key's names to drop
    data = zygote.run_request("broker", "broker.server", [], drop=["OPENAI_API_KEY"],
                              credential=True)
    assert zygote.parse_request(data) == zygote.ForkRequest(
        "broker", None, True, "broker.server", (), ("OPENAI_API_KEY",))
    with pytest.raises(ValueError, match="does not run"):
        zygote.run_request("x", "os", [])
    assert zygote.parse_request(b"run x os " + json.dumps([]).encode()) is None
    assert zygote.parse_request(b"run x actors.writer not-json") is None
    assert zygote.parse_request(b"run x actors.writer [1, 2]") is None
    assert zygote.parse_request(b'run x actors.writer {"a": 1}') is None
    assert zygote.parse_request(b'run x actors.writer {"argv": [1]}') is None
    assert zygote.parse_request(b'run x actors.writer {"argv": [], "drop": [2]}') is None
    assert zygote.parse_request(b'run x actors.writer {"argv": ["a\0b"]}') is None
    assert zygote.parse_request(b"run") is None
    # the agent forms are unchanged
    assert zygote.parse_request(zygote.fork_request("agent-1")) == zygote.ForkRequest("agent-1")


def test_scrub_removes_a_variable_from_the_environment_and_proc_environ() -> None:
    """A restarted writer drops the model key the zygote holds: gone from
    os.environ, from its children, and from /proc/<pid>/environ."""
    code = (
        "import os, subprocess\n"
        "from actors import envscrub\n"
        "before = open('/proc/self/environ', 'rb').read()\n"
        "envscrub.scrub(['CORRAL_TEST_KEY'])\n"
        "after = open('/proc/self/environ', 'rb').read()\n"
        "child = subprocess.run(['env'], capture_output=True).stdout\n"
        "print(b'sk-scrub-me' in before, b'sk-scrub-me' in after, b'sk-scrub-me' in child,\n"
        "      'CORRAL_TEST_KEY' in os.environ, b'CORRAL_KEEP=1' in after)\n"
    )
    env = {**os.environ, "CORRAL_TEST_KEY": "sk-scrub-me", "CORRAL_KEEP": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=30).stdout
    assert out.split() == ["True", "False", "False", "False", "True"]
