"""The wire between a zygote (actors/zygote.py) and its parent
(actors/zygotelink.py): one datagram a message on their SOCK_SEQPACKET
socketpair. This module owns the format:

    from the zygote, once, after preloading
        b"ready <zygote pid>"
    request
        b"fork <name>"                  stdout/stderr are the zygote's (the supervisor)
        b"fork <name> <output path>"    stdout and stderr go to <output path>, opened
                                        by the zygote before it forks (O_WRONLY|O_CREAT|
                                        O_APPEND|O_CLOEXEC, 0600; the path is the rest of
                                        the datagram, spaces included)
        b'run <name> <module> {"argv": [...], "drop": [...]}'
                                        the same fork, but the child runs `main(argv)` of
                                        one of RUNNABLE's modules (the writer, the broker,
                                        procs, subagents) instead of an agent: their
                                        starts pay a fork, not a fresh interpreter's
                                        imports; it first removes the environment names
                                        in "drop" (the model key the zygote holds and the
                                        writer, broker and procs must not); stdout/stderr
                                        are the zygote's
        Any form may carry one file descriptor (SCM_RIGHTS): a *start gate*,
        the read end of a pipe. The agent, once adopted, reads one byte from it
        and runs only on b"g"; on EOF (the requester closed the write end: it
        gave up, or died) it exits 125 without running anything. The subagents
        host records the agent's pid durably before it opens the gate.
        Any form may end with b"\0c": then the first file descriptor is a
        pipe holding the child's credential (broker/auth.py), read by the
        agent after the fork (the zygote never reads it), and the gate, if
        any, is the second.
    reply
        b"forked <name> <pid>"   or   b"failed <name> <reason>"
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

# `python -m <key>` -> the module whose `main(argv)` a `run` request calls (nothing else runs)
RUNNABLE = {"actors.writer": "actors.writer.process", "broker.server": "broker.server",
            "actors.procs": "actors.procs.__main__",
            "actors.subagents": "actors.subagents.__main__"}


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Forked:
    name: str
    pid: int


@dataclass(frozen=True)
class ForkFailed:
    name: str
    reason: str


@dataclass(frozen=True)
class ForkRequest:
    name: str
    output: bytes | None = None  # a path (bytes: any file name the OS accepts)
    credential: bool = False  # the first fd is the agent's credential pipe
    module: str | None = None  # `run`: a key of RUNNABLE; None: an agent
    argv: tuple[str, ...] = ()  # `run`: the arguments of its main()
    drop: tuple[str, ...] = ()  # `run`: environment names the child removes (the model key)


_CREDENTIAL_MARK = b"\0c"


def fork_request(name: str, output: str | os.PathLike[str] | None = None, *,
                 credential: bool = False) -> bytes:
    data = f"fork {name}".encode()
    data = data if output is None else data + b" " + os.fsencode(output)
    return data + _CREDENTIAL_MARK if credential else data


def run_request(name: str, module: str, argv: list[str], *, drop: Sequence[str] = (),
                credential: bool = False) -> bytes:
    """Ask for a child running `python -m <module> <argv>`'s main, forked; it
    removes the environment names `drop` before it runs (the zygote holds the
    model key, which the writer and broker must not)."""
    if module not in RUNNABLE:
        raise ValueError(f"the zygote does not run {module}")
    data = f"run {name} {module} ".encode() + json.dumps(
        {"argv": list(argv), "drop": list(drop)}).encode()
    return data + _CREDENTIAL_MARK if credential else data


def parse_request(data: bytes) -> ForkRequest | None:
    """Parse one request datagram; None when it is not one."""
    credential = data.endswith(_CREDENTIAL_MARK)
    if credential:
        data = data.removesuffix(_CREDENTIAL_MARK)
    word, _, rest = data.partition(b" ")
    name, _, output = rest.partition(b" ")
    if not name or b"\0" in data:
        return None
    if word == b"run":
        return _parse_run(name, output, credential)
    if word != b"fork":
        return None
    return ForkRequest(name.decode("utf-8", "replace"), output or None, credential)


def _parse_run(name: bytes, rest: bytes, credential: bool) -> ForkRequest | None:
    module, _, raw = rest.partition(b" ")
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    text = module.decode("utf-8", "replace")
    if text not in RUNNABLE or not isinstance(body, dict):
        return None
    argv, drop = body.get("argv"), body.get("drop", [])
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) \
            or not isinstance(drop, list) or not all(isinstance(d, str) for d in drop):
        return None
    return ForkRequest(name.decode("utf-8", "replace"), None, credential, text,
                       tuple(argv), tuple(drop))


def parse_reply(data: bytes) -> Ready | Forked | ForkFailed:
    """Parse one datagram from the zygote; ValueError when it is not one."""
    text = data.decode("utf-8", "replace")
    if text.startswith("ready "):
        return Ready(int(text.removeprefix("ready ")))
    word, name, rest = text.split(" ", 2)
    if word == "forked":
        return Forked(name, int(rest))
    if word == "failed":
        return ForkFailed(name, rest)
    raise ValueError(f"unknown zygote reply {word!r}")
