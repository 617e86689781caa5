"""An agent: one OS process per agent running one session (`process.serve`):
the loop (`loop`), the op catalogue it installs (`catalog`, with the ops of
`builtin_ops` and `mcp_ops`) and the model backends (`backends`,
`openai_backend`). It sits on top: what it drives (state, ops, gate,
settings) is the kernel below, actors/kernel/. See docs/agents.md."""
