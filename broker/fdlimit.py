"""A server's file-descriptor limit. The writer and the broker hold a
connection for every actor (the writer two: its ROUTER's and its lane's),
and a soft limit of 1,024 (a common default) would stop them accepting at a
few hundred agents; so each raises its soft limit towards the hard one at
start, as servers do (nginx's worker_rlimit_nofile, systemd's LimitNOFILE)."""

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
