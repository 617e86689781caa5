"""The web console: `supervisor console [--listen 127.0.0.1:PORT]` (docs/console.md).

A Starlette application served by uvicorn in a process of its own: the agents
at a glance, a session's trace, the operator's queue and storage, updated live
by server-sent events. Modules: `guard` (the login token, the cookie session,
CSRF, request bounds), `views` (the data each page reads, from the same
sources as the CLI), `live` (one status poller shared by every open page),
`app` (routes), `serve` (the command). Nothing else imports this package:
`supervisor up` and `status` never load it.
"""
