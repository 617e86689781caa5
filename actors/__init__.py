"""The processes that do the work: the writer (and the WAL format), agents,
the procs and subagents hosts. May import `broker`; never `supervisor`."""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
