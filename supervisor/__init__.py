"""The process tree: child specs, restart policy, spawning, status and the CLI.

May import `broker` and `actors`. See docs/supervisor.md and
docs/architecture.md ("Layers").
"""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
