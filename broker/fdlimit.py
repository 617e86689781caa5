"""A server's file-descriptor limit, raised towards the hard limit at start.

The writer and the broker hold a connection (the writer two) per actor.
"""

from __future__ import annotations

import resource

CEILING = 65_536


def raise_fd_limit(ceiling: int = CEILING) -> int:
    """Raise the soft RLIMIT_NOFILE to min(hard, `ceiling`) unless it is
    higher already; the soft limit in force afterwards (unchanged when the
    system refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft
