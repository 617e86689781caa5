"""One background command: its wrapper, exit file, cap and lifetime.

See docs/procs.md ("Commands").
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from actors.procs.job import Job, state_for

BASH = "/bin/bash"
# $1 command, $2 log, $3 cap bytes, $4 exit file, $5... the sandbox's argv prefix
WRAPPER = r"""
exec -c "${@:5}" /bin/bash -c "$1" </dev/null 2>&1 | stdbuf -o0 head -c "$3" >>"$2"
s=${PIPESTATUS[0]}
printf '%s' "$s" >"$4.tmp" && mv -f "$4.tmp" "$4"
exit "$s"
"""


def wrapper_argv(command: str, log_path: str, cap_bytes: int, exit_path: str,
                 sandbox_prefix: Sequence[str] = ()) -> list[str]:
    return [BASH, "-c", WRAPPER, "corral-proc", command, log_path, str(cap_bytes), exit_path,
            *sandbox_prefix]


def read_exit_file(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return int(f.read().strip() or b"-1")
    except (FileNotFoundError, ValueError):
        return None


class Command(Job):
    """Refreshed by the host every tick while it runs."""

    def refresh(self) -> bool:
        """Apply the cap and the lifetime; settle the state once the wrapper
        is gone. Returns True when the state changed to an end state."""
        if not self.running:
            return False
        if not self.leader_gone():
            if self.log_size() >= self.entry.cap_bytes:
                self.kill("cap")
            elif self.expired():
                self.kill("lifetime")
            elif self.quota is not None and self.quota.exceeded():
                self.kill("quota")
            self.escalate()
            return False
        exit_code = read_exit_file(self.entry.exit_path)
        if exit_code is None and self.wait_status is not None:
            exit_code = os.waitstatus_to_exitcode(self.wait_status)
        self.entry.exit_code = exit_code
        if self.entry.kill_reason is None and self.log_size() >= self.entry.cap_bytes:
            self.kill("cap")  # ended by SIGPIPE at the cap: sweep what is left
        if self.entry.kill_reason is not None:
            self.entry.state = state_for(self.entry.kill_reason)
        elif self.ours or read_exit_file(self.entry.exit_path) is not None:
            self.entry.state = "exited"
        else:
            self.entry.state = "lost"
        return True
