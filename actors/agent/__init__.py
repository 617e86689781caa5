"""An agent: one OS process per agent running one session.

The loop, typed ops, the gate, model backends and state recovery.
See docs/agents.md.
"""
