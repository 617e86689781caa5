"""The base of every registry entry: a strict, closed, frozen pydantic model.

See docs/registries.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
