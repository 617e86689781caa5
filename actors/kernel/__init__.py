"""The agent kernel: what every actor that serves an agent shares, importing
nothing above it: the state and its fold (`state`, `branch_events`,
`pipeline_track`, `generations`, `compaction`), the op registry (`ops`), the
settings (`settings`), the workspace and the gate (`workspace`, `gate`,
`commands`), the model's reply types (`reply`), operator inputs and the
input vault. The loop that drives them is actors/agent/. See docs/agents.md."""
