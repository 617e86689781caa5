"""Pipelines: a closed, deterministic DSL of typed op steps run by the agent loop.

Steps pass the same gate, recording and recovery as an agent's ops.
See docs/pipelines.md.
"""
