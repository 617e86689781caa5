"""The ops of the agent issue: files, search, memory, todos, ask and finish.
Each is one model and one handler, registered at import (actors/agent/ops.py
explains the contract). Handlers read; writes are returned as `Write` and
applied by the loop after it has recorded them."""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.agent import workspace
from actors.agent.ops import Done, OpBase, OpContext, Outcome, Write, register

MemoryKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
MAX_LIST_ENTRIES = 1000
MAX_SEARCH_FILE_BYTES = 1024 * 1024


def _protected(ctx: OpContext) -> list[Any]:
    return [ctx.state_dir.state_dir, ctx.state_dir.config_dir]


def _path(ctx: OpContext, rel: str, *, write: bool = False) -> Any:
    return workspace.resolve(ctx.workspace, rel, write=write, protected=_protected(ctx))


def _clip(text: str, ctx: OpContext) -> tuple[str, bool]:
    if len(text) <= ctx.max_result_chars:
        return text, False
    return text[: ctx.max_result_chars], True


def _error(message: str) -> Done:
    return Done({"error": message}, ok=False)


class ReadFile(OpBase):
    """Read a text file of the workspace."""

    op: Literal["read_file"] = "read_file"
    path: str
    path_field: ClassVar[str | None] = "path"


def read_file(op: ReadFile, ctx: OpContext) -> Outcome:
    target = _path(ctx, op.path)
    try:
        text = target.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return _error("no such file")
    except IsADirectoryError:
        return _error("is a directory")
    content, truncated = _clip(text, ctx)
    return Done({"content": content, "chars": len(text), "truncated": truncated})


class WriteFile(OpBase):
    """Create or replace a text file of the workspace."""

    op: Literal["write_file"] = "write_file"
    path: str
    content: str
    path_field: ClassVar[str | None] = "path"
    mutates: ClassVar[bool] = True


def write_file(op: WriteFile, ctx: OpContext) -> Outcome:
    target = _path(ctx, op.path, write=True)
    if target.is_dir():
        return _error("is a directory")
    data = op.content.encode()
    return Write(target, op.path, data, {"bytes": len(data)})


class EditFile(OpBase):
    """Replace an exact text in a file: `old` must occur once (or set replace_all)."""

    op: Literal["edit_file"] = "edit_file"
    path: str
    old: Annotated[str, Field(min_length=1)]
    new: str
    replace_all: bool = False
    path_field: ClassVar[str | None] = "path"
    mutates: ClassVar[bool] = True


def edit_file(op: EditFile, ctx: OpContext) -> Outcome:
    target = _path(ctx, op.path, write=True)
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _error("no such file")
    except (IsADirectoryError, UnicodeDecodeError):
        return _error("not a text file")
    count = text.count(op.old)
    if count == 0:
        return _error("old text not found")
    if count > 1 and not op.replace_all:
        return _error(f"old text occurs {count} times; set replace_all")
    new_text = text.replace(op.old, op.new) if op.replace_all else text.replace(op.old, op.new, 1)
    replaced = count if op.replace_all else 1
    return Write(target, op.path, new_text.encode(), {"replacements": replaced})


class ListDir(OpBase):
    """List a directory of the workspace."""

    op: Literal["list_dir"] = "list_dir"
    path: str = "."
    path_field: ClassVar[str | None] = "path"


def list_dir(op: ListDir, ctx: OpContext) -> Outcome:
    target = ctx.workspace if op.path in ("", ".") else _path(ctx, op.path)
    try:
        names = sorted(os.listdir(target))
    except FileNotFoundError:
        return _error("no such directory")
    except NotADirectoryError:
        return _error("not a directory")
    entries = []
    for name in names[:MAX_LIST_ENTRIES]:
        if name.endswith(".corral-tmp"):
            continue
        full = target / name
        kind = "link" if full.is_symlink() else "dir" if full.is_dir() else "file"
        entries.append({"name": name, "kind": kind})
    return Done({"entries": entries, "truncated": len(names) > MAX_LIST_ENTRIES})


class Search(OpBase):
    """Find lines containing a literal text in the workspace's files."""

    op: Literal["search"] = "search"
    text: Annotated[str, Field(min_length=1)]
    path: str = "."
    max_results: Annotated[int, Field(ge=1, le=1000)] = 100
    path_field: ClassVar[str | None] = "path"


def search(op: Search, ctx: OpContext) -> Outcome:
    root = ctx.workspace if op.path in ("", ".") else _path(ctx, op.path)
    real_root = os.path.realpath(ctx.workspace)
    matches: list[dict[str, Any]] = []
    files = [root] if root.is_file() else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs  # no symlinked dirs
    )
    for name in files:
        real = os.path.realpath(name)
        if not real.startswith(real_root + os.sep) or os.path.getsize(real) > MAX_SEARCH_FILE_BYTES:
            continue
        try:
            with open(real, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if op.text in line:
                        rel = os.path.relpath(real, real_root)
                        matches.append({"path": rel, "line": number, "text": line.rstrip()[:200]})
                        if len(matches) >= op.max_results:
                            return Done({"matches": matches, "truncated": True})
        except (UnicodeDecodeError, OSError):
            continue
    return Done({"matches": matches, "truncated": False})


class MemoryWrite(OpBase):
    """Save a note to the agent's persistent memory (.corral/memory/<agent>/<key>.md)."""

    op: Literal["memory_write"] = "memory_write"
    key: MemoryKey
    content: str
    mutates: ClassVar[bool] = True


def memory_write(op: MemoryWrite, ctx: OpContext) -> Outcome:
    data = op.content.encode()
    target = ctx.memory_dir / f"{op.key}.md"
    return Write(target, f"memory:{op.key}", data, {"bytes": len(data)})


class MemoryRead(OpBase):
    """Read a note from the agent's persistent memory."""

    op: Literal["memory_read"] = "memory_read"
    key: MemoryKey


def memory_read(op: MemoryRead, ctx: OpContext) -> Outcome:
    try:
        text = (ctx.memory_dir / f"{op.key}.md").read_text(encoding="utf-8")
    except FileNotFoundError:
        return _error("no such memory")
    content, truncated = _clip(text, ctx)
    return Done({"content": content, "truncated": truncated})


class TodoItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    text: Annotated[str, Field(max_length=500)]
    done: bool = False


class Todos(OpBase):
    """Replace the agent's todo list."""

    op: Literal["todos"] = "todos"
    items: Annotated[list[TodoItem], Field(max_length=100)]


def todos(op: Todos, ctx: OpContext) -> Outcome:
    items = [item.model_dump() for item in op.items]
    return Done({"count": len(items)}, facts=[("todos", {"items": items})])


class Ask(OpBase):
    """Ask the operator a question and wait for the answer."""

    op: Literal["ask"] = "ask"
    question: Annotated[str, Field(min_length=1, max_length=2000)]
    needs_operator: ClassVar[bool] = True


def ask(op: Ask, ctx: OpContext) -> Outcome:
    answer = ctx.answer or {}
    return Done({"answer": answer.get("decision"), "note": answer.get("note")})


class Finish(OpBase):
    """End the session: the task is done."""

    op: Literal["finish"] = "finish"
    summary: Annotated[str, Field(max_length=4000)] = ""
    ends_session: ClassVar[bool] = True


def finish(op: Finish, ctx: OpContext) -> Outcome:
    return Done({"finished": True})


for _model, _handler in (
    (ReadFile, read_file), (WriteFile, write_file), (EditFile, edit_file),
    (ListDir, list_dir), (Search, search), (MemoryWrite, memory_write),
    (MemoryRead, memory_read), (Todos, todos), (Ask, ask), (Finish, finish),
):
    register(_model, _handler)
