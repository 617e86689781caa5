"""The processes that do the work: the writer, agents, the procs and subagents hosts.

May import `broker`; never `supervisor`. See docs/architecture.md ("Layers").
"""
