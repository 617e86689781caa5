"""The message plane: wire protocol, state-directory paths, logging set-up, the
broker process and the client side actors use. Imports nothing from `actors` or
`supervisor`."""

from broker import lazystdlib

lazystdlib.defer()  # before any module imports structlog (broker/lazystdlib.py)
