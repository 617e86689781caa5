"""What the request handlers may touch of a running supervisor: the
`RuntimeFace` protocol that supervisor/runtime.py's `Runtime` satisfies, so
the handlers (supervisor/requests.py) need not import the runtime that calls
them. See docs/architecture.md.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from broker.statedir import StateDir
    from supervisor.children import Child
    from supervisor.config import Config
    from supervisor.spawner import ZygoteLink


class RuntimeFace(Protocol):
    """The runtime's children, configuration and zygote, and its three moves
    on a child: start it, start the zygote, terminate it."""

    config: Config
    config_path: Path | None
    state_dir: StateDir
    children: dict[str, Child]
    phase: int
    stopping: bool
    fork_queue: deque[Child]
    zygote: ZygoteLink | None
    zygote_restart_at: float | None
    use_zygote: bool
    zygote_stale: bool

    def _start(self, child: Child, now: float) -> None: ...

    def _start_zygote(self, now: float) -> None: ...

    def _terminate(self, child: Child, now: float) -> None: ...
