"""structlog set-up, called once from each process's main(), never on import.

See docs/operations.md ("Logs").
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any

import structlog

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_BACKUPS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The logging options every process's command line takes (the supervisor
    passes the configuration's `logging:` section to each child through them)."""
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--log-backups", type=int, default=DEFAULT_BACKUPS)


# the process's actor, read at each line: a process forked from a configured
# one (an agent from the zygote) configures again, and loggers cached before
# the fork must then name the new actor
_identity: dict[str, str] = {}


def _add_identity(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """`actor` and `pid` on every line, also a thread's (threads do not inherit
    the main thread's context variables)."""
    if "actor" in _identity:
        event.setdefault("actor", _identity["actor"])
    event.setdefault("pid", os.getpid())
    return event


def configure(
    actor: str,
    log_path: Path | None,
    *,
    level: str = "info",
    max_bytes: int = DEFAULT_MAX_BYTES,
    backups: int = DEFAULT_BACKUPS,
    console: bool | None = None,
) -> structlog.stdlib.BoundLogger:
    """Route structlog through stdlib handlers and bind the process identity.

    `console=None` means: render to stderr only when stderr is a terminal.
    Every line carries `actor` and `pid` (docs/operations.md), also a thread's."""
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    _identity["actor"] = actor
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _add_identity,
        structlog.stdlib.add_log_level,
        timestamper,
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level.upper())

    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.handlers.RotatingFileHandler(
            log_path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
        file_handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(),
                ],
                foreign_pre_chain=shared,
            )
        )
        root.addHandler(file_handler)

    if console is None:
        console = sys.stderr.isatty()
    if console:
        stream_handler = logging.StreamHandler(sys.stderr)
        stream_handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
                ],
                foreign_pre_chain=shared,
            )
        )
        root.addHandler(stream_handler)

    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(actor=actor, pid=os.getpid())
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(actor)
    return logger
