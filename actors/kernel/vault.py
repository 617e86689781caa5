"""The agent's input vault: an op's secret fields kept outside the WAL.

See docs/agents.md and docs/security.md ("Secrets").
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Any

from actors.kernel.ops import model_for
from broker.durable import fsync_dir, write_atomic

SEALED_KEYS = frozenset({"sha256", "bytes"})
REFUSED_KEY = "refused"
_DIGEST = re.compile(r"[0-9a-f]{64}")


class SealedInputMissingError(Exception):
    """A sealed field's text is not in the vault (or does not match its hash)."""

    def __init__(self, field: str) -> None:
        super().__init__(f"{field}: the sealed input is gone from this agent's vault")
        self.field = field


def _secret_fields(action: object) -> tuple[str, ...]:
    if not isinstance(action, dict):
        return ()
    name = action.get("op")
    model = model_for(name) if isinstance(name, str) else None
    return model.secret_fields if model is not None else ()


def is_sealed(value: object) -> bool:
    return isinstance(value, dict) and set(value) == SEALED_KEYS


def is_refused(value: object) -> bool:
    """A secret field that was not a string, replaced by a note of its type."""
    return isinstance(value, dict) and set(value) == {REFUSED_KEY}


def strings_in(value: object) -> list[str]:
    """Every string inside `value` (lists, objects: keys and values)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings_in(k), *strings_in(v))]
    if isinstance(value, list | tuple):
        return [s for item in value for s in strings_in(item)]
    return []


class Vault:
    def __init__(self, agent_dir: Path) -> None:
        self.dir = agent_dir / "vault"
        self._empty = False  # known empty (cleared by this process, nothing sealed since)

    def seal(self, actions: list[Any]) -> list[Any]:
        """Clear the vault, keep every secret text of `actions` in it (durably)
        and return the actions with those texts replaced by their seals. A
        secret field that is not a string (a list, a number: any shape the
        model sends) is replaced by a note of its type, which the op's schema
        then refuses: its content is never recorded."""
        self.clear()
        out: list[Any] = []
        for action in actions:
            fields = [f for f in _secret_fields(action) if f in action
                      and not is_sealed(action[f])]
            if not fields:
                out.append(action)
                continue
            sealed = dict(action)
            for name in fields:
                if not isinstance(action[name], str):  # refused by the op's schema, unseen
                    sealed[name] = {REFUSED_KEY: f"not a string ({type(action[name]).__name__})"}
                    continue
                data = str(action[name]).encode("utf-8", "surrogatepass")
                digest = hashlib.sha256(data).hexdigest()
                self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._empty = False
                write_atomic(self.dir / digest, data, sync_dir=False)
                sealed[name] = {"sha256": digest, "bytes": len(data)}
            if self.dir.exists():
                fsync_dir(self.dir)
            out.append(sealed)
        return out

    def open(self, action: object) -> object:
        """`action` with its sealed fields filled from the vault; raises
        SealedInputMissingError when a text is missing or altered."""
        if not isinstance(action, dict):
            return action
        fields = [f for f in _secret_fields(action) if is_sealed(action.get(f))]
        if not fields:
            return action
        opened = dict(action)
        for name in fields:
            digest = str(action[name]["sha256"])
            try:
                data = (self.dir / digest).read_bytes() if _DIGEST.fullmatch(digest) else None
            except OSError:
                data = None
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                raise SealedInputMissingError(name)
            opened[name] = data.decode("utf-8", "surrogatepass")
        return opened

    def clear(self) -> None:
        """Forget every kept text (no open turn refers to them any more),
        durably: the directory is fsynced after the unlinks."""
        if self._empty:
            return
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            self._empty = True
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
        if names:
            fsync_dir(self.dir)
        self._empty = True
