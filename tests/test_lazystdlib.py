"""Process starts do not load asyncio (broker/lazystdlib.py): the writer's,
the broker's, the hosts' and the agent's imports leave the stand-in in place,
and a module that took the stand-in before the load uses the real asyncio."""

from __future__ import annotations

import subprocess
import sys

import pytest

MAINS = ["actors.writer.__main__", "broker.server", "actors.procs.__main__",
         "actors.subagents.__main__", "actors.agent.__main__", "actors.zygote",
         "supervisor.cli.main"]


@pytest.mark.parametrize("module", MAINS)
def test_a_process_start_does_not_load_asyncio(module: str) -> None:
    code = (f"import sys, {module}; m = sys.modules['asyncio']; "
            "print(type(m).__name__, 'ssl' in sys.modules, 'asyncio.base_events' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.split() == ["_Deferred", "False", "False"], done.stdout


def test_a_reference_taken_before_the_load_works_after_it() -> None:
    code = ("import sys, broker, structlog.stdlib\n"
            "early = sys.modules['asyncio']\n"
            "import asyncio\n"
            "assert asyncio is early\n"
            "assert asyncio.run(asyncio.sleep(0, result=7)) == 7\n"
            "assert type(sys.modules['asyncio']).__name__ == 'module'\n"
            "assert early.get_running_loop is sys.modules['asyncio'].get_running_loop\n"
            "import asyncio.events\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
