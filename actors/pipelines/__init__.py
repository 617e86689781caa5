"""Pipelines: a closed, deterministic DSL of typed op steps run by the agent loop
under the same gate, recording and recovery as an agent's ops (docs/pipelines.md)."""
