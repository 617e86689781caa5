"""The message plane: wire protocol, paths, logging, the broker and its client.

Imports nothing from `actors` or `supervisor`. See docs/architecture.md
("Layers") and docs/decisions.md ("Shared low-level modules live in
`broker/`").
"""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
