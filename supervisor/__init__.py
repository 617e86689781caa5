"""The process tree (runtime/), the operator's CLI (cli/), the console, the fleet.

May import `broker` and `actors`. See docs/supervisor.md ("Code layout") and
docs/architecture.md ("Layers").
"""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
