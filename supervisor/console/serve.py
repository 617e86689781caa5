"""`supervisor console [--listen HOST:PORT] [--config F]`: serve the console.

Loopback unless `console: {allow_remote: true}`; the login URL is printed,
never logged. See docs/console.md ("Security").
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
from pathlib import Path

from broker.errors import ConfigError
from broker.statedir import StateDir

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_CONFIG = 78
DEFAULT_LISTEN = "127.0.0.1:0"


class ListenError(ValueError):
    """`--listen` is not host:port, or not an address this console may serve on."""


def parse_listen(text: str, *, allow_remote: bool) -> tuple[str, int]:
    """`127.0.0.1:8080`, `[::1]:0`, `localhost:0` -> (host, port); a non-loopback
    host only with `allow_remote`."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ListenError(f"--listen {text!r}: expected host:port (e.g. 127.0.0.1:8080)")
    if host == "localhost":
        return "127.0.0.1", int(port_text)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ListenError(f"--listen {text!r}: the host must be an IP address or "
                          "localhost") from None
    if not address.is_loopback and not allow_remote:
        raise ListenError(f"--listen {text!r} is not a loopback address: the console "
                          "serves 127.0.0.1 or ::1 unless the configuration says "
                          "`console: {allow_remote: true}`")
    return host, int(port_text)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def run(args: argparse.Namespace) -> int:
    """The command (supervisor/cli/console.py dispatches `console` here)."""
    import uvicorn  # noqa: PLC0415 - only this command needs the server

    from supervisor.config import load  # noqa: PLC0415
    from supervisor.console.app import create_app  # noqa: PLC0415
    from supervisor.console.guard import Guard  # noqa: PLC0415

    try:
        config = load(Path(args.config) if args.config else None)
    except ConfigError as exc:
        print(f"supervisor: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        host, port = parse_listen(args.listen or DEFAULT_LISTEN,
                                  allow_remote=config.console.allow_remote)
        sock = bind(host, port)
    except ListenError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"supervisor: cannot listen on {args.listen}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    state_dir = StateDir.resolve(args.state_dir)
    guard = Guard()
    app = create_app(state_dir, guard, args.config)
    bound = sock.getsockname()[1]
    base = f"http://{url_host(host)}:{bound}"
    print(f"supervisor: console of {state_dir.root} at {base}/\n"
          f"supervisor: log in (once) with {base}/login?token={guard.token}", flush=True)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
        h11_max_incomplete_event_size=16 * 1024, limit_concurrency=256, lifespan="off"))
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the
    # handler found before it: a no-op one, so a stop asked for ends with 0
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """`python -m supervisor.console`: the same command without the CLI around it."""
    parser = argparse.ArgumentParser(prog="supervisor console")
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--listen", default=None)
    return run(parser.parse_args(argv))
