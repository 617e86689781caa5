"""The console's routes: the page, the read endpoints, the live streams, answers.

Answers go through `operator_act`, as `supervisor approve` does. See
docs/console.md ("Pages", "Security").
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib.resources import files
from typing import Annotated, Any, Literal

import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.statedir import StateDir, check_actor_name
from supervisor import statusclient
from supervisor.cli import agents as agent_commands
from supervisor.console import views
from supervisor.console.guard import COOKIE, BodyTooLargeError, Guard, GuardMiddleware
from supervisor.console.live import Hub

STATIC = files("supervisor.console") / "static"
ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self'; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
TEXT_CHARS = 32 * 1024  # an answer or a correction (the body is bounded too: guard.py)
Name = Annotated[str, Field(min_length=1, max_length=64)]
Ident = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ApprovalBody(_Body):
    agent: Name
    request: Ident
    decision: Literal["approve", "deny"]
    always: bool = False
    note: Annotated[str, Field(max_length=2000)] | None = None


class AnswerBody(_Body):
    agent: Name
    request: Ident
    text: Annotated[str, Field(min_length=1, max_length=TEXT_CHARS)]


class CorrectionBody(_Body):
    agent: Name
    text: Annotated[str, Field(min_length=1, max_length=TEXT_CHARS)]


def _security_headers(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      *((k.encode(), v.encode()) for k, v in HEADERS.items())]
            await send(message)

        await app(scope, receive, with_headers if scope["type"] == "http" else send)

    return wrapped


def _refused(status: int, error: str) -> JSONResponse:
    return JSONResponse({"ok": False, "error": error}, status_code=status)


def _agent(request: Request) -> str:
    name = str(request.path_params["agent"])
    check_actor_name(name)  # CorralError: answered 400 by the handler below
    return name


def create_app(state_dir: StateDir, guard: Guard, config_path: str | None = None,
               hub: Hub | None = None) -> Starlette:
    """The console for `state_dir`; `guard` holds its login token and sessions."""
    live = hub or Hub(state_dir)

    async def login(request: Request) -> Response:
        session = guard.login(request.query_params.get("token", ""))
        if session is None:
            return _refused(401, "this login URL is wrong or already used: run "
                                 "`supervisor console` again for a new one")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, session, httponly=True, samesite="strict", path="/")
        return response

    async def page(request: Request) -> Response:
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    async def asset(request: Request) -> Response:
        name = str(request.path_params["name"])
        if name not in ASSETS:
            return _refused(404, "no such file")
        return FileResponse(str(STATIC / name), media_type=ASSETS[name])

    async def favicon(request: Request) -> Response:
        return Response(status_code=204)

    async def session_info(request: Request) -> Response:
        sid = request.scope["state"]["console_session"]
        return JSONResponse({"csrf": guard.sessions[sid], "state_dir": str(state_dir.root)})

    async def agents(request: Request) -> Response:
        try:
            rows = await anyio.to_thread.run_sync(views.status_rows, state_dir, live.limits)
        except (statusclient.NoAnswerError, statusclient.RefusedError, OSError) as exc:
            return _refused(503, f"no answer from the supervisor of {state_dir.root}: {exc}")
        return JSONResponse({"rows": rows})

    async def queue(request: Request) -> Response:
        return JSONResponse({"queue": await live.refresh_queue()})

    async def events(request: Request) -> Response:
        return StreamingResponse(live.listen(), media_type="text/event-stream")

    async def trace(request: Request) -> Response:
        agent = _agent(request)
        since = _since(request)
        follower = views.TraceFollower(state_dir, agent)
        try:
            records, next_seq = await anyio.to_thread.run_sync(follower.read, since)
        finally:
            follower.close()
        return JSONResponse({"records": records, "next": next_seq})

    async def trace_events(request: Request) -> Response:
        agent = _agent(request)
        return StreamingResponse(_follow(state_dir, agent, _since(request)),
                                 media_type="text/event-stream")

    async def session_view(request: Request) -> Response:
        agent = _agent(request)
        return JSONResponse(await anyio.to_thread.run_sync(views.session, state_dir, agent))

    async def storage(request: Request) -> Response:
        return JSONResponse(await anyio.to_thread.run_sync(views.storage_usage, state_dir,
                                                           config_path))

    async def act(request: Request, action: Any, agent: str) -> Response:
        try:
            line = await anyio.to_thread.run_sync(agent_commands.operator_act, state_dir, agent,
                                                  action)
        except agent_commands.OperatorRefusedError as exc:  # the CLI's line; usage: 400
            return _refused(400 if exc.code == agent_commands.EXIT_USAGE else 409, str(exc))
        await live.refresh_queue()
        return JSONResponse({"ok": True, "line": line})

    async def approve(request: Request) -> Response:
        body = ApprovalBody.model_validate(await _json(request))
        if body.always and body.decision == "deny":
            return _refused(400, "--always applies to approve only")
        return await act(request, agent_commands.approval_action(
            body.agent, body.request, deny=body.decision == "deny", always=body.always,
            note=body.note), body.agent)

    async def answer(request: Request) -> Response:
        body = AnswerBody.model_validate(await _json(request))
        return await act(request, agent_commands.answer_action(
            state_dir, body.agent, body.request, body.text), body.agent)

    async def correct(request: Request) -> Response:
        body = CorrectionBody.model_validate(await _json(request))
        return await act(request,
                         agent_commands.correction_action(state_dir, body.agent, body.text),
                         body.agent)

    async def too_large(request: Request, exc: Exception) -> Response:
        return _refused(413, str(exc))

    async def unavailable(request: Request, exc: Exception) -> Response:
        return _refused(503, str(exc))  # the WAL or the session index cannot be read now

    async def invalid(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            return _refused(400, f"{where}: {first.get('msg')}")
        return _refused(400, str(exc))

    from actors.sessions.index import SessionIndexError  # noqa: PLC0415
    from broker.errors import CorralError  # noqa: PLC0415
    from supervisor.trace import TraceError  # noqa: PLC0415

    routes = [
        Route("/login", login), Route("/", page), Route("/static/{name}", asset),
        Route("/favicon.ico", favicon),
        Route("/api/session", session_info), Route("/api/agents", agents),
        Route("/api/queue", queue), Route("/api/events", events),
        Route("/api/trace/{agent}", trace), Route("/api/trace/{agent}/events", trace_events),
        Route("/api/sessions/{agent}", session_view), Route("/api/storage", storage),
        Route("/api/approve", approve, methods=["POST"]),
        Route("/api/answer", answer, methods=["POST"]),
        Route("/api/correct", correct, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_security_headers), Middleware(GuardMiddleware, guard=guard)],
        exception_handlers={BodyTooLargeError: too_large, ValidationError: invalid,
                            CorralError: invalid, ValueError: invalid,
                            TraceError: unavailable, SessionIndexError: unavailable},
    )
    app.state.hub = live
    return app


def _since(request: Request) -> int:
    text = request.query_params.get("since", "1")
    if not text.isdigit() or len(text) > 19 or int(text) < 1:
        raise ValueError(f"since {text[:40]!r}: expected a WAL seq (a whole number >= 1)")
    return int(text)


async def _json(request: Request) -> Any:
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise ValueError("expected a JSON body (content-type application/json)")
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body is not JSON: {exc.msg if hasattr(exc, 'msg') else exc}"
                         ) from exc


async def _follow(state_dir: StateDir, agent: str, since: int) -> AsyncIterator[bytes]:
    """A session's trace, following: what was appended since, every FOLLOW_S."""
    import asyncio  # noqa: PLC0415

    from supervisor.console.live import frame  # noqa: PLC0415

    follower = views.TraceFollower(state_dir, agent)
    next_seq = since
    idle = 0.0
    try:
        while True:
            records, next_seq = await anyio.to_thread.run_sync(follower.read, next_seq)
            if records:
                idle = 0.0
                yield frame("trace", {"records": records, "next": next_seq})
            elif idle >= 15.0:
                idle = 0.0
                yield b": keepalive\n\n"
            await asyncio.sleep(FOLLOW_S)
            idle += FOLLOW_S
    finally:
        follower.close()


FOLLOW_S = 0.5
