"""Who may use the console (login token, cookie, CSRF), and request bounds.

See docs/console.md ("Security").
"""

from __future__ import annotations

import hmac
import json
import secrets
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "corral_console"
CSRF_HEADER = "x-csrf-token"
MAX_BODY_BYTES = 64 * 1024
MAX_SESSIONS = 64  # open browser sessions kept; the oldest goes first


@dataclass
class Guard:
    """The login token and the open sessions (session id -> CSRF token)."""

    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    sessions: dict[str, str] = field(default_factory=dict)
    spent: bool = False

    def login(self, offered: str) -> str | None:
        """A new session id for the right, unspent token; else None."""
        if self.spent or not hmac.compare_digest(offered.encode(), self.token.encode()):
            return None
        self.spent = True
        session = secrets.token_urlsafe(32)
        while len(self.sessions) >= MAX_SESSIONS:
            self.sessions.pop(next(iter(self.sessions)))
        self.sessions[session] = secrets.token_urlsafe(32)
        return session

    def session_of(self, scope: Scope) -> str | None:
        """The request's session id, when its cookie names an open session."""
        for name, value in scope.get("headers", []):
            if name != b"cookie":
                continue
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # noqa: BLE001 - http.cookies raises CookieError and others
                return None
            morsel = jar.get(COOKIE)
            if morsel is not None:
                sid = morsel.value
                if any(hmac.compare_digest(sid.encode(), s.encode()) for s in self.sessions):
                    return sid
        return None

    def csrf_ok(self, session: str, scope: Scope) -> bool:
        headers = dict(scope.get("headers", []))
        offered = headers.get(CSRF_HEADER.encode(), b"")
        return hmac.compare_digest(offered, self.sessions[session].encode())


def _origin_ok(scope: Scope) -> bool:
    """No Origin header (not a browser's cross-site request), or one naming this host."""
    headers = dict(scope.get("headers", []))
    origin = headers.get(b"origin")
    if origin is None:
        return True
    host = headers.get(b"host", b"")
    return origin in (b"http://" + host, b"https://" + host)


async def _refuse(send: Send, status: int, reason: str) -> None:
    body = json.dumps({"ok": False, "error": reason}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Cookie, CSRF, Origin and body size, before any route runs."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/login" and method == "GET":
            await self.app(scope, receive, send)
            return
        session = self.guard.session_of(scope)
        if session is None:
            await _refuse(send, 401, "no console session: open the login URL that "
                                     "`supervisor console` printed")
            return
        if method not in ("GET", "HEAD"):
            if not _origin_ok(scope):
                await _refuse(send, 403, "cross-origin request refused")
                return
            if not self.guard.csrf_ok(session, scope):
                await _refuse(send, 403, "missing or wrong CSRF token")
                return
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit()
                                     or int(declared) > MAX_BODY_BYTES):
            await _refuse(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
            return
        scope.setdefault("state", {})["console_session"] = session
        await self.app(scope, _bounded(receive), send)


class BodyTooLargeError(Exception):
    """A request body passed MAX_BODY_BYTES while it was read."""


def _bounded(receive: Receive) -> Receive:
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message: dict[str, Any] = dict(await receive())
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise BodyTooLargeError(f"request body over {MAX_BODY_BYTES} bytes")
        return message

    return wrapped
