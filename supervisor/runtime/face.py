"""What the request handlers may touch of a running supervisor: the
`RuntimeFace` protocol that supervisor/runtime/loop.py's `Runtime` satisfies, so
the handlers (supervisor/runtime/requests.py) need not import the runtime that calls
them. See docs/architecture.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from broker.statedir import StateDir
    from supervisor.config import Config
    from supervisor.runtime.children import Child
    from supervisor.runtime.starter import Starter


class RuntimeFace(Protocol):
    """The runtime's children, configuration and starter (the fork queue and
    the zygote), and its two moves on a child: start it, terminate it."""

    config: Config
    config_path: Path | None
    state_dir: StateDir
    children: dict[str, Child]
    phase: int
    stopping: bool
    starter: Starter

    def start(self, child: Child, now: float) -> None: ...

    def terminate(self, child: Child, now: float) -> None: ...
