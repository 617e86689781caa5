"""The built-in ops: files, search, memory, todos, ask and finish.

Handlers read; writes are returned as `Write` and applied by the loop after
it has recorded them. See docs/agents.md ("Ops").
"""

from __future__ import annotations

import os
import stat
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.changesets import confined
from actors.kernel import workspace
from actors.kernel.ops import Done, OpBase, OpContext, OpSpec, Outcome, Write

MemoryKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
MAX_LIST_ENTRIES = 1000
MAX_SEARCH_FILE_BYTES = 1024 * 1024


def _place(ctx: OpContext, raw: str) -> workspace.Place:
    return workspace.place(ctx.workspace, raw, workspace.guard_for(ctx.state_dir))


def _memory(ctx: OpContext, key: str) -> workspace.Place:
    return workspace.Place(ctx.memory_dir, f"{key}.md", workspace.guard_for(ctx.state_dir))


def _visible(ctx: OpContext, rel: str) -> bool:
    """Whether the permission rules let this op show `rel` (search results,
    directory entries): the loop passes the rules' verdict as a filter."""
    return ctx.path_visible is None or ctx.path_visible(rel)


def _clip(text: str, ctx: OpContext) -> tuple[str, bool]:
    if len(text) <= ctx.max_result_chars:
        return text, False
    return text[: ctx.max_result_chars], True


def _error(message: str) -> Done:
    return Done({"error": message}, ok=False)


def _read_text(where: workspace.Place) -> str | Done:
    try:
        data = workspace.read_bytes(where)
    except confined.UnsafeFileError as exc:
        return _error("is a directory" if exc.kind == "is_a_directory" else exc.reason)
    except NotADirectoryError:
        return _error("no such file")
    if data is None:
        return _error("no such file")
    return data.decode("utf-8", errors="replace")


class ReadFile(OpBase):
    """Read a text file of the workspace."""

    op: Literal["read_file"] = "read_file"
    path: str
    path_field: ClassVar[str | None] = "path"


def read_file(op: ReadFile, ctx: OpContext) -> Outcome:
    text = _read_text(_place(ctx, op.path))
    if isinstance(text, Done):
        return text
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
    where = _place(ctx, op.path)
    if not where.parts:
        return _error("is a directory")
    workspace.check(where, want_dir=False)
    data = op.content.encode()
    return Write(where, op.path, data, {"bytes": len(data)})


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
    where = _place(ctx, op.path)
    try:
        data = workspace.read_bytes(where)
    except confined.UnsafeFileError as exc:
        return _error("not a text file" if exc.kind == "is_a_directory" else exc.reason)
    except NotADirectoryError:
        data = None
    if data is None:
        return _error("no such file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _error("not a text file")
    count = text.count(op.old)
    if count == 0:
        return _error("old text not found")
    if count > 1 and not op.replace_all:
        return _error(f"old text occurs {count} times; set replace_all")
    new_text = text.replace(op.old, op.new) if op.replace_all else text.replace(op.old, op.new, 1)
    replaced = count if op.replace_all else 1
    return Write(where, op.path, new_text.encode(), {"replacements": replaced})


class ListDir(OpBase):
    """List a directory of the workspace."""

    op: Literal["list_dir"] = "list_dir"
    path: str = "."
    path_field: ClassVar[str | None] = "path"


def _kind(st: os.stat_result) -> str:
    return "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"


def list_dir(op: ListDir, ctx: OpContext) -> Outcome:
    where = _place(ctx, op.path or ".")
    prefix = "" if where.rel == "." else where.rel + "/"
    try:
        with confined.open_root(where.root) as root_fd, \
                confined.walk(root_fd, where.parts, where.guard) as dir_fd:
            entries = []
            names = sorted(os.listdir(dir_fd))
            for name in names[:MAX_LIST_ENTRIES]:
                st = confined.lstat_at(dir_fd, name)
                if st is None or name.endswith(confined.TMP_SUFFIX) or not _visible(
                        ctx, prefix + name):
                    continue
                if stat.S_ISDIR(st.st_mode) and confined.identity(st) in where.guard.protected:
                    continue  # the state directory is not shown, as it cannot be entered
                entries.append({"name": name, "kind": _kind(st)})
    except FileNotFoundError:
        return _error("no such directory")
    except confined.UnsafeFileError as exc:
        return _error("not a directory" if exc.kind == "not_a_directory" else exc.reason)
    return Done({"entries": entries, "truncated": len(names) > MAX_LIST_ENTRIES})


class Search(OpBase):
    """Find lines containing a literal text in the workspace's files."""

    op: Literal["search"] = "search"
    text: Annotated[str, Field(min_length=1)]
    path: str = "."
    max_results: Annotated[int, Field(ge=1, le=1000)] = 100
    path_field: ClassVar[str | None] = "path"


class _EnoughFoundError(Exception):
    """Enough matches: stop walking."""


def _search_file(fd: int, rel: str, op: Search, matches: list[dict[str, Any]]) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or st.st_size > MAX_SEARCH_FILE_BYTES:
        return
    try:
        text = confined.read_all(fd, MAX_SEARCH_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        return
    for number, line in enumerate(text.splitlines(), 1):
        if op.text in line:
            matches.append({"path": rel, "line": number, "text": line.rstrip()[:200]})
            if len(matches) >= op.max_results:
                raise _EnoughFoundError


def _search_dir(dir_fd: int, parts: list[str], op: Search, ctx: OpContext, *,
                guard: confined.Guard, matches: list[dict[str, Any]]) -> None:
    for name in sorted(os.listdir(dir_fd)):
        child = [*parts, name]
        rel = "/".join(child)
        st = confined.lstat_at(dir_fd, name)
        if st is None or stat.S_ISLNK(st.st_mode) or name.endswith(confined.TMP_SUFFIX):
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = confined.open_dir(dir_fd, name, child, guard)
            except (OSError, confined.UnsafeFileError):
                continue  # a link swapped in, the state directory, gone: not searched
            try:
                _search_dir(sub, child, op, ctx, guard=guard, matches=matches)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode) and _visible(ctx, rel):
            try:
                fd = confined.open_file(dir_fd, name, child, guard)
            except (OSError, confined.UnsafeFileError):
                continue
            try:
                _search_file(fd, rel, op, matches)
            finally:
                os.close(fd)


def search(op: Search, ctx: OpContext) -> Outcome:
    where = _place(ctx, op.path or ".")
    matches: list[dict[str, Any]] = []
    try:
        with confined.open_root(where.root) as root_fd:
            if where.parts:
                with confined.walk(root_fd, where.parts[:-1], where.guard) as dir_fd:
                    st = confined.lstat_at(dir_fd, where.parts[-1])
                    if st is None:
                        return _error("no such file or directory")
                    if not stat.S_ISDIR(st.st_mode):
                        fd = confined.open_file(dir_fd, where.parts[-1], where.parts,
                                                where.guard)
                        try:
                            _search_file(fd, where.rel, op, matches)
                        finally:
                            os.close(fd)
                        return Done({"matches": matches, "truncated": False})
            with confined.walk(root_fd, where.parts, where.guard) as dir_fd:
                _search_dir(dir_fd, where.parts, op, ctx, guard=where.guard, matches=matches)
    except _EnoughFoundError:
        return Done({"matches": matches, "truncated": True})
    except FileNotFoundError:
        return _error("no such file or directory")
    return Done({"matches": matches, "truncated": False})


class MemoryWrite(OpBase):
    """Save a note to the agent's persistent memory (.corral/memory/<agent>/<key>.md)."""

    op: Literal["memory_write"] = "memory_write"
    key: MemoryKey
    content: str
    mutates: ClassVar[bool] = True


def memory_write(op: MemoryWrite, ctx: OpContext) -> Outcome:
    data = op.content.encode()
    return Write(_memory(ctx, op.key), f"memory:{op.key}", data, {"bytes": len(data)})


class MemoryRead(OpBase):
    """Read a note from the agent's persistent memory."""

    op: Literal["memory_read"] = "memory_read"
    key: MemoryKey


def memory_read(op: MemoryRead, ctx: OpContext) -> Outcome:
    try:
        text = _read_text(_memory(ctx, op.key))
    except FileNotFoundError:
        text = _error("no such file")
    if isinstance(text, Done):
        return _error("no such memory") if text.result.get("error") == "no such file" else text
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
    replay_safe: ClassVar[bool] = True  # no effect: run again after a crash, never re-asked


def ask(op: Ask, ctx: OpContext) -> Outcome:
    answer = ctx.answer or {}
    # the exact answer is not a tool result: it reaches the model once, as user
    # input with the next model request (actors/kernel/operator_input.py)
    return Done({"answered": answer.get("decision") == "answered",
                 "request": answer.get("request"),
                 "delivery": "the operator's answer follows as user input"})


class Finish(OpBase):
    """End the session: the task is done."""

    op: Literal["finish"] = "finish"
    summary: Annotated[str, Field(max_length=4000)] = ""
    ends_session: ClassVar[bool] = True


def finish(op: Finish, ctx: OpContext) -> Outcome:
    return Done({"finished": True})


# local: they read, or return a Write the loop applies
OPS = tuple(OpSpec(model, handler, local=True) for model, handler in (
    (ReadFile, read_file), (WriteFile, write_file), (EditFile, edit_file),
    (ListDir, list_dir), (Search, search), (MemoryWrite, memory_write),
    (MemoryRead, memory_read), (Todos, todos), (Ask, ask), (Finish, finish),
))
