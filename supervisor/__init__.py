"""The process tree: child specs, restart policy, spawning, status and the CLI.

May import `broker` and `actors`. See docs/supervisor.md and
docs/architecture.md ("Layers").
"""
