"""An agent: one OS process per agent running one session (`process.serve`):
the loop (`loop`), typed ops (`ops`, `builtin_ops`, `catalog`), the gate
(`gate`, `workspace`), model backends (`backends`, `openai_backend`), and
state recovery (`state`, `generations`, `rebuild`). See docs/agents.md."""
