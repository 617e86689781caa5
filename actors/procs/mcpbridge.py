"""MCP servers as supervised children of procs, one instance per sender.

See docs/mcp.md ("procs' side (actors/procs/mcpbridge.py)").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog

from actors.procs import sandbox
from actors.registries import entries as registries
from actors.registries import store
from broker import protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from broker.statedir import StateDir

log = structlog.get_logger("procs.mcp")

MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_DESCRIPTION_CHARS = 1024
MAX_RESULT_BYTES = 256 * 1024
START_TIMEOUT_S = 30.0  # a server's initialize and tools/list
IMPORT_MARGIN_S = 30.0  # the SDK's first import in procs takes seconds
REMEMBERED_CALLS = 256
REPLY_MARGIN_S = 5.0


class McpRefusal(Exception):  # noqa: N818 - a typed refusal, not a bug
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail[:1000]


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, stopping past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def bounded_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The server's tools as plain JSON, or a refusal when any bound is passed."""
    if len(tools) > MAX_TOOLS:
        raise McpRefusal("schema_too_large", f"the server offers {len(tools)} tools "
                                             f"(at most {MAX_TOOLS})")
    out = []
    for tool in tools:
        schema = tool.input_schema
        text = json.dumps(schema, separators=(",", ":"))
        if len(text) > MAX_SCHEMA_BYTES or _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise McpRefusal("schema_too_large",
                             f"tool {str(tool.name)[:64]!r}: its input schema passes "
                             f"{MAX_SCHEMA_BYTES} bytes or {MAX_SCHEMA_DEPTH} levels")
        hints = tool.annotations
        out.append({
            "name": str(tool.name)[:128],
            "description": str(tool.description or "")[:MAX_DESCRIPTION_CHARS],
            "input_schema": schema,
            "read_only": bool(hints and hints.read_only_hint),
            "idempotent": bool(hints and hints.idempotent_hint),
        })
    return out


class _Transport:
    """The server's stdin/stdout as the SDK's memory streams, lines bounded."""

    def __init__(self, process: anyio.abc.Process) -> None:
        from mcp.shared.message import SessionMessage  # noqa: PLC0415

        self.process = process
        self.session_message = SessionMessage
        self.read_send, self.read_recv = anyio.create_memory_object_stream[Any](16)
        self.write_send, self.write_recv = anyio.create_memory_object_stream[Any](16)
        self.failure: str | None = None

    async def reader(self) -> None:
        from mcp import types  # noqa: PLC0415

        assert self.process.stdout is not None
        buffer = b""
        try:
            async with self.read_send:
                async for chunk in self.process.stdout:
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    if len(buffer) > MAX_LINE_BYTES or any(len(x) > MAX_LINE_BYTES
                                                           for x in lines):
                        self.failure = f"the server wrote a line of more than {MAX_LINE_BYTES} B"
                        break
                    for line in lines:
                        if not line.strip():
                            continue
                        try:
                            message = types.jsonrpc_message_adapter.validate_json(line)
                        except ValueError as exc:
                            await self.read_send.send(exc)
                            continue
                        await self.read_send.send(self.session_message(message))
                    if self.failure:
                        break
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass
        finally:
            with contextlib.suppress(ProcessLookupError, OSError):
                self.process.kill()

    async def writer(self) -> None:
        assert self.process.stdin is not None
        try:
            async with self.write_recv:
                async for message in self.write_recv:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await self.process.stdin.send(data.encode() + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass


class ServerInstance:
    """One server for one sender: a thread, its loop, its process and session."""

    def __init__(self, sender: str, entry: registries.McpServerEntry, argv: list[str],
                 cwd: str, filter_fd: int | None = None) -> None:
        self.sender = sender
        self.entry = entry
        self.argv = argv
        self.cwd = cwd
        self.filter_fd = filter_fd  # the sandbox's seccomp filter, read by its bwrap
        self.loop = asyncio.new_event_loop()
        self.queue: asyncio.Queue[tuple[str, str | None, dict[str, Any], str, Future[Any]]] | None \
            = None
        self.ready: Future[list[dict[str, Any]]] = Future()
        self.dead = threading.Event()
        self.failure = ""
        self.remembered: OrderedDict[str, Future[Any]] = OrderedDict()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mcp-{sender}-{entry.name}")
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except Exception as exc:  # noqa: BLE001 - any failure ends this instance only
            self.failure = self.failure or f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            if self.filter_fd is not None:  # ended before its process was started
                with contextlib.suppress(OSError):
                    os.close(self.filter_fd)
                self.filter_fd = None
            self.dead.set()
            if not self.ready.done():
                self.ready.set_exception(McpRefusal("server_failed", self.failure or "ended"))
            log.info("mcp_server_ended", session=self.sender, server=self.entry.name,
                     reason=self.failure or "closed")
            with contextlib.suppress(Exception):
                self.loop.close()

    async def _main(self) -> None:
        from mcp.client.session import ClientSession  # noqa: PLC0415

        self.queue = asyncio.Queue()
        try:
            process = await anyio.open_process(
                self.argv, stdin=-1, stdout=-1, stderr=-3, cwd=self.cwd, env={},
                start_new_session=True,
                pass_fds=() if self.filter_fd is None else (self.filter_fd,))
        finally:
            if self.filter_fd is not None:  # bwrap holds its own copy now (or never will)
                os.close(self.filter_fd)
                self.filter_fd = None
        transport = _Transport(process)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(transport.reader)
                tg.start_soon(transport.writer)
                try:
                    async with ClientSession(transport.read_recv, transport.write_send) as session:
                        with anyio.fail_after(START_TIMEOUT_S):
                            await session.initialize()
                            listed = await session.list_tools()
                        try:
                            self.ready.set_result(bounded_tools(list(listed.tools)))
                        except McpRefusal as exc:
                            self.ready.set_exception(exc)
                        await self._serve(session, transport)
                finally:
                    tg.cancel_scope.cancel()
        except Exception as exc:
            self.failure = transport.failure or f"{type(exc).__name__}: {str(exc)[:300]}"
            raise
        finally:
            with contextlib.suppress(ProcessLookupError, OSError):
                process.kill()
            with contextlib.suppress(Exception), anyio.move_on_after(2):
                await process.wait()
            if transport.failure:
                self.failure = transport.failure

    async def _serve(self, session: Any, transport: _Transport) -> None:
        assert self.queue is not None
        while True:
            action, tool, arguments, _msg_id, future = await self.queue.get()
            if action == "close":
                return
            try:
                with anyio.fail_after(self.entry.call_timeout_s):
                    result = await session.call_tool(tool or "", arguments)
                body = result.model_dump(mode="json", by_alias=True, exclude_none=True)
                size = len(json.dumps(body, separators=(",", ":")))
                if size > MAX_RESULT_BYTES:
                    future.set_exception(McpRefusal(
                        "result_too_large", f"the result has {size} bytes "
                                            f"(at most {MAX_RESULT_BYTES})"))
                else:
                    future.set_result(body)
            except TimeoutError:
                future.set_exception(McpRefusal("timeout", f"no answer within "
                                                           f"{self.entry.call_timeout_s}s"))
            except Exception as exc:  # noqa: BLE001 - the server died or broke the protocol
                reason = transport.failure or f"{type(exc).__name__}: {str(exc)[:300]}"
                future.set_exception(McpRefusal(
                    "result_too_large" if transport.failure else "server_failed", reason))
                self.failure = reason  # this instance ends; the next request starts another
                return

    def call(self, tool: str, arguments: dict[str, Any], msg_id: str) -> Future[Any]:
        known = self.remembered.get(msg_id)
        if known is not None:
            return known
        future: Future[Any] = Future()
        self.remembered[msg_id] = future
        while len(self.remembered) > REMEMBERED_CALLS:
            self.remembered.popitem(last=False)
        queue = self.queue
        if self.dead.is_set() or queue is None:
            future.set_exception(McpRefusal("server_failed", self.failure or "not running"))
            return future
        self.loop.call_soon_threadsafe(queue.put_nowait, ("call", tool, arguments, msg_id,
                                                          future))
        return future

    def close(self) -> None:
        queue = self.queue
        if queue is not None and not self.dead.is_set():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(queue.put_nowait,
                                               ("close", None, {}, "", Future()))


class _Options(Protocol):
    @property
    def sandbox(self) -> sandbox.SandboxPolicy: ...


class BridgeHost(Protocol):
    """What the bridge uses of procs' host (actors/procs/host.py `ProcsHost`,
    which owns the bridge and passes itself)."""

    @property
    def state(self) -> StateDir: ...

    @property
    def options(self) -> _Options: ...

    def workspace_of(self, session: str) -> str: ...

    def confinement(self, session: str, cwd: str) -> sandbox.Confinement: ...

    def argv_prefix(self, confinement: sandbox.Confinement, cwd: str, env: dict[str, str],
                    proc_id: str, filter_fd: int | None = None) -> list[str]: ...

    def defer(self, sender: str, msg_id: str, ready: Callable[[], bool],
              reply: Callable[[], protocol.Message], *, timeout_s: float,
              on_due: Callable[[], None] | None = None) -> None: ...


class McpBridge:
    """procs' side: the registry, the instances by (sender, server), replies."""

    def __init__(self, host: BridgeHost) -> None:
        self.host = host
        self.instances: dict[tuple[str, str], ServerInstance] = {}
        self._seq: int | None = None
        self._entries: dict[str, registries.McpServerEntry] = {}
        self._error: str | None = None

    def warm(self) -> None:
        """Import the SDK in the background when servers are installed (its
        first import takes seconds): called once when procs starts."""
        if self.entries():
            threading.Thread(target=_import_sdk, daemon=True, name="mcp-import").start()

    def entries(self) -> dict[str, registries.McpServerEntry]:
        """The installed servers: the `mcp` registry's newest generation, read
        again when a newer one is written (the last good one is kept)."""
        seq = store.newest_seq(self.host.state, "mcp")
        if seq != self._seq:
            self._seq = seq
            try:
                self._entries, self._error = store.load_mcp(self.host.state), None
            except store.RegistryError as exc:
                self._error = str(exc)
                log.error("mcp_registry_refused", reason=self._error)
        return self._entries

    def _instance(self, sender: str, entry: registries.McpServerEntry) -> ServerInstance:
        key = (sender, entry.name)
        instance = self.instances.get(key)
        if instance is not None and not instance.dead.is_set() and instance.entry == entry:
            return instance
        if instance is not None:
            instance.close()
        workspace = self.host.workspace_of(sender)
        confinement = self.host.confinement(sender, workspace)
        env = {**sandbox.clean_env(os.environ), **entry.env}
        # the same seccomp filter as every command's (docs/security.md): an
        # agent-installed server must not ptrace its way out either
        filter_fd = sandbox.seccomp_fd(self.host.options.sandbox)
        argv = [*self.host.argv_prefix(confinement, workspace, env,
                                   f"mcp-{entry.name}", filter_fd), *entry.command]
        instance = self.instances[key] = ServerInstance(sender, entry, argv, workspace,
                                                        filter_fd)
        log.info("mcp_server_started", session=sender, server=entry.name)
        return instance

    def handle(self, sender: str, message: protocol.McpRequest) -> protocol.Message | None:
        """Reply now (a refusal) or defer the reply until the instance answers."""
        entry = self.entries().get(message.server)
        if entry is None or not entry.enabled:
            return self._refuse(message.msg_id, "unknown_server",
                                f"no MCP server {message.server!r} is installed")
        instance = self._instance(sender, entry)
        if message.action == "list":
            future: Future[Any] = instance.ready
            timeout_s = IMPORT_MARGIN_S + START_TIMEOUT_S + REPLY_MARGIN_S
        else:
            try:
                arguments = json.loads(message.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict) or not message.tool:
                return self._refuse(message.msg_id, "bad_request",
                                    "a call needs a tool and a JSON object of arguments")
            future = Future()
            tool = message.tool

            def after_ready(ready: Future[Any]) -> None:
                if ready.exception() is not None:
                    future.set_exception(ready.exception())
                    return
                inner = instance.call(tool, arguments, message.msg_id)
                inner.add_done_callback(lambda f: _copy(f, future))

            instance.ready.add_done_callback(after_ready)
            timeout_s = (IMPORT_MARGIN_S + START_TIMEOUT_S + entry.call_timeout_s
                         + REPLY_MARGIN_S)
        msg_id = message.msg_id
        self.host.defer(sender, msg_id, future.done, lambda: self._reply(msg_id, future),
                        timeout_s=timeout_s)
        return None

    @staticmethod
    def _refuse(msg_id: str, code: str, detail: str) -> protocol.McpReply:
        return protocol.McpReply(msg_id=msg_id, ok=False, error=code, detail=detail[:1000],
                                 body=b"null")

    def _reply(self, msg_id: str, future: Future[Any]) -> protocol.McpReply:
        if not future.done():
            return self._refuse(msg_id, "timeout", "the server did not answer in time")
        exc = future.exception()
        if isinstance(exc, McpRefusal):
            return self._refuse(msg_id, exc.code, exc.detail)
        if exc is not None:
            return self._refuse(msg_id, "server_failed", f"{type(exc).__name__}")
        value = future.result()
        body = json.dumps({"tools": value} if isinstance(value, list) else value,
                          separators=(",", ":")).encode()
        return protocol.McpReply(msg_id=msg_id, ok=True, error=None, detail="", body=body)

    def end_session(self, sender: str) -> None:
        for key in [k for k in self.instances if k[0] == sender]:
            self.instances.pop(key).close()

    def shutdown(self) -> None:
        for instance in self.instances.values():
            instance.close()
        for instance in self.instances.values():
            instance.dead.wait(3)
        self.instances.clear()


def _import_sdk() -> None:
    with contextlib.suppress(Exception):
        import mcp.client.session  # noqa: F401, PLC0415


def _copy(source: Future[Any], target: Future[Any]) -> None:
    if target.done():
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())

