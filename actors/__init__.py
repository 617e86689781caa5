"""The processes that do the work: the writer, agents, the procs and subagents hosts.

May import `broker`; never `supervisor`. See docs/architecture.md ("Layers").
"""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
