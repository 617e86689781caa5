"""The process tree: child specs, restart policy, spawning, status and the
`supervisor` command line. May import `broker` and `actors`."""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
