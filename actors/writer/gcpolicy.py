"""The writer's garbage collection while it serves.

CPython's cyclic collector walks every tracked object of a generation; a
full (gen-2) collection in the writer walked everything start-up had loaded
(pydantic's, structlog's and ZeroMQ's modules, the recovered indexes) and
took 20-40 ms at 64 appenders: a stop of the loop that every waiting append
paid (docs/performance.md, "The writer's tail"). What start-up made lives as
long as the process, so once the writer is ready it is collected once and
frozen (`gc.freeze`: moved to a generation no collection visits); automatic
collection stays on for what serving makes, which is small and short-lived,
so a full collection afterwards walks only that."""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what start-up left, then exempt the survivors from every later
    collection. Call once, after recovery and before serving."""
    gc.collect()
    gc.freeze()
