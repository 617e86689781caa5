"""broker/fdlimit.py: a server raises its soft fd limit towards the hard one."""

from __future__ import annotations

import resource
import subprocess
import sys

from broker.fdlimit import CEILING


def test_a_low_soft_limit_is_raised_to_the_hard_limit_or_the_ceiling() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    code = ("import resource; from broker.fdlimit import raise_fd_limit; "
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=low,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split() == [str(max(256, expected))] * 2
