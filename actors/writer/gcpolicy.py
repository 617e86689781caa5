"""The writer's garbage collection while it serves.

Once ready, what start-up made is collected once and frozen (`gc.freeze`), so
a full collection walks only what serving makes.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what start-up left, then exempt the survivors from every later
    collection. Call once, after recovery and before serving."""
    gc.collect()
    gc.freeze()
