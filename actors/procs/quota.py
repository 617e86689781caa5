"""The workspace quota of a job: the bytes it may add to its workspace.

See docs/security.md ("Per-job limits").
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

CHECK_S = 0.25
DUTY = 20  # the pause after a look is at least DUTY times what the look took
MAX_ENTRIES = 200_000
BLOCK_BYTES = 512  # st_blocks' unit


def usage_bytes(root: str, max_entries: int = MAX_ENTRIES) -> int:
    """Allocated bytes of the regular files under `root` (links not followed)."""
    total, seen = 0, 0
    stack = [root]
    while stack and seen < max_entries:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * BLOCK_BYTES
                except OSError:
                    continue
    return total


@dataclass
class WorkspaceQuota:
    """One job's quota on its workspace."""

    workspace: str
    limit_bytes: int
    base_bytes: int
    next_check: float = field(default_factory=lambda: time.monotonic() + CHECK_S)

    @classmethod
    def start(cls, workspace: str, limit_bytes: int) -> WorkspaceQuota:
        return cls(workspace, limit_bytes, usage_bytes(workspace))

    def exceeded(self) -> bool:
        """Look (at most every CHECK_S): True once the workspace grew past the quota."""
        now = time.monotonic()
        if now < self.next_check:
            return False
        used = usage_bytes(self.workspace)
        took_s = time.monotonic() - now
        self.next_check = now + took_s + max(CHECK_S, DUTY * took_s)
        return used - self.base_bytes > self.limit_bytes
