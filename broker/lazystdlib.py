"""Standard-library modules that corral's processes import through their
dependencies but rarely use, loaded at first use instead of at start.

structlog imports asyncio at import time for its async logging methods, which
no corral process calls: asyncio (with ssl, selectors, concurrent.futures) was
about 65 ms of every process's start. `defer()` puts a stand-in module in its
place: `import asyncio` returns it (it has the real module's `__spec__`, so the
import system takes it as loaded), and the first read of an attribute it lacks
(a process that does use asyncio: the MCP bridge, the console) imports the real
module, puts it in sys.modules and copies its namespace into the stand-in, so a
reference taken before the load works after it. (importlib.util.LazyLoader
cannot do this: on Python 3.11 the import statement itself reads `__spec__`
and so loads it.) Called by each package's `__init__`, before any corral
module imports structlog. docs/decisions.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

DEFERRED = ("asyncio",)
_lock = threading.RLock()


class _Deferred(types.ModuleType):
    """A module imported at the first read of an attribute it lacks."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__") and attr != "__path__":
            raise AttributeError(attr)  # copy, pickle and inspect probe these
        return getattr(self._load(), attr)

    def _load(self) -> types.ModuleType:
        name = self.__name__
        with _lock:
            current = sys.modules.get(name)
            if current is self or current is None:
                sys.modules.pop(name, None)
                try:
                    real = importlib.import_module(name)
                except BaseException:
                    sys.modules[name] = self
                    raise
            else:
                real = current
            self.__dict__.update(real.__dict__)
            return real


def defer() -> None:
    """Put a stand-in for each DEFERRED module unless it is already imported."""
    for name in DEFERRED:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        module = _Deferred(name)
        module.__spec__ = spec
        sys.modules[name] = module
