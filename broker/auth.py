"""Authenticated actors: who is on the other end of a socket, and what it may do.

Owns the ZAP handler, the credentials below `keys/`, their delivery to
children and the refusal rules. See docs/protocol.md ("Authentication") and
docs/decisions.md ("Actors authenticate with ZAP + PLAIN; the broker routes
by authenticated name").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import zmq
import zmq.auth
import zmq.utils.z85

from broker.errors import CorralError
from broker.statedir import NAME_PATTERN, StateDir

USER_ID = "User-Id"  # the ZMQ message property carrying the authenticated name
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"corral"
ENV_CREDENTIAL_FD = "CORRAL_CREDENTIAL_FD"  # the number of the inherited fd, not a secret

OPERATOR = "operator"
PROCS = "procs"
SUBAGENTS = "subagents"
AUTOMATION = "automation"  # the supervisor's schedules and hooks (supervisor/automation.py)
# names no agent may take: runtime roles, and the origins they append under
RESERVED = frozenset({OPERATOR, PROCS, SUBAGENTS, "writer", "broker", "supervisor",
                      "zygote", "changesets", AUTOMATION})
# facts only the operator may append: answers, budget resumes, and any later
# operator input (a new kind of operator fact must be added here)
OPERATOR_EVENTS = frozenset({"approval_answer", "budget_resumed", "operator_answer",
                             "operator_correction", "operator_note"})

_MAGIC = b"corral-credential-v1"
_MAX_CREDENTIAL_BYTES = 512
REFUSAL_LOGS_PER_S = 20

log = structlog.get_logger("auth")


class AuthError(CorralError):
    """A credential could not be made, read or delivered."""


@dataclass(frozen=True)
class Credential:
    """An actor's name and password (and, for the subagents host, the key that
    mints its children's passwords). Never printed: repr hides the secrets."""

    name: str
    secret: bytes = field(repr=False)
    mint: bytes | None = field(default=None, repr=False)

    def encode(self) -> bytes:
        """The form that travels on a pipe or in a zygote fork request."""
        return b"\n".join([_MAGIC, self.name.encode(), self.secret,
                           self.mint.hex().encode() if self.mint else b""]) + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> Credential:
        lines = data.split(b"\n")
        if len(data) > _MAX_CREDENTIAL_BYTES or len(lines) < 4 or lines[0] != _MAGIC:
            raise AuthError("not a corral credential")
        name = lines[1].decode("ascii", "replace")
        if not NAME_PATTERN.fullmatch(name):
            raise AuthError("the credential names no valid actor")
        try:
            mint = bytes.fromhex(lines[3].decode("ascii")) if lines[3] else None
        except ValueError as exc:
            raise AuthError("the credential's mint key is not hex") from exc
        return cls(name, lines[2], mint)

    def child(self, name: str) -> Credential:
        """A subagent child's credential (needs the subagents host's mint key)."""
        if self.mint is None:
            raise AuthError(f"{self.name} cannot mint credentials")
        if "." not in name or not NAME_PATTERN.fullmatch(name):
            raise AuthError(f"{name!r} is not a child's name (<parent>.<id>)")
        return Credential(name, _mac(self.mint, name.encode()).hex().encode())


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


class Keyring:
    """The master key, and every actor's password derived from it."""

    def __init__(self, master: bytes) -> None:
        self._master = master
        self._mint = _mac(master, b"mint:" + SUBAGENTS.encode())

    def password(self, name: str) -> bytes:
        if "." in name:
            return _mac(self._mint, name.encode()).hex().encode()
        return _mac(self._master, b"actor:" + name.encode()).hex().encode()

    def credential(self, name: str) -> Credential:
        if not NAME_PATTERN.fullmatch(name):
            raise AuthError(f"invalid actor name {name!r}")
        return Credential(name, self.password(name),
                          self._mint if name == SUBAGENTS else None)

    def verify(self, name: str, password: bytes) -> bool:
        if not NAME_PATTERN.fullmatch(name):
            return False
        return hmac.compare_digest(self.password(name), password)


# --- the key files ----------------------------------------------------------------
def keys_dir(state_dir: StateDir) -> Path:
    return state_dir.root / "keys"


def _write_once(path: Path, data: bytes) -> None:
    """Create `path` (0600) holding `data`, unless it exists; never half-written:
    the data goes to a private temp file that is then hard-linked into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _read_private(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def ensure_keys(state_dir: StateDir) -> Keyring:
    """The state directory's keyring; makes master.key and operator.key when absent."""
    directory = keys_dir(state_dir)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        master_path = directory / "master.key"
        if not master_path.exists():
            _write_once(master_path, secrets.token_bytes(32))
        master = _read_private(master_path)
        if len(master) != 32:
            raise AuthError(f"{master_path} is damaged ({len(master)} bytes, expected 32)")
        keyring = Keyring(master)
        operator_path = directory / "operator.key"
        if not operator_path.exists():
            _write_once(operator_path, keyring.credential(OPERATOR).encode())
    except OSError as exc:
        raise AuthError(f"cannot make or read the keys in {directory}: {exc}") from exc
    return keyring


def operator_credential(state_dir: StateDir) -> Credential:
    """The operator's credential from operator.key (made with the keys if absent)."""
    path = keys_dir(state_dir) / "operator.key"
    try:
        data = _read_private(path)
    except FileNotFoundError:
        ensure_keys(state_dir)
        data = _read_private(path)
    except OSError as exc:
        raise AuthError(f"cannot read the operator credential {path}: {exc}") from exc
    return Credential.decode(data)


# --- delivery to children ---------------------------------------------------------
def credential_pipe(credential: Credential) -> int:
    """The read end of a pipe holding `credential` (write end closed), inheritable:
    pass it to exactly one child (pass_fds) and close it after the spawn."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, credential.encode())
    finally:
        os.close(write_fd)
    os.set_inheritable(read_fd, True)
    return read_fd


def child_env_entry(fd: int) -> dict[str, str]:
    return {ENV_CREDENTIAL_FD: str(fd)}


_process: Credential | None = None


def set_process_credential(credential: Credential | None) -> None:
    """This process's own credential (a zygote's child sets it after the fork)."""
    global _process  # noqa: PLW0603 - one credential per process, read by every client
    _process = credential


def process_credential(state_dir: StateDir) -> Credential:
    """This process's credential: set by `set_process_credential`, else read (once)
    from the fd CORRAL_CREDENTIAL_FD names, else the operator's. A process told
    of an fd that cannot be read fails: it never falls back to another identity."""
    global _process  # noqa: PLW0603
    if _process is not None:
        return _process
    fd_text = os.environ.pop(ENV_CREDENTIAL_FD, None)
    if fd_text is not None:
        _process = _read_fd(fd_text)
        return _process
    return operator_credential(state_dir)


def child_credential(state_dir: StateDir, name: str) -> Credential:
    """A subagent child's credential, minted by this process (the subagents host,
    with its mint key; or a process acting as the operator, from the keyring)."""
    own = process_credential(state_dir)
    if own.mint is not None:
        return own.child(name)
    if own.name == OPERATOR:
        return ensure_keys(state_dir).credential(name)
    raise AuthError(f"{own.name} may not start the child {name!r}")


def default_credential(endpoint: str) -> Credential | None:
    """This process's credential for an endpoint of a state directory
    (`ipc://<dir>/run/<name>.sock`); None for others (a tcp:// endpoint needs
    CURVE keys, broker/curve.py; an ipc socket elsewhere is no runtime's)."""
    if not endpoint.startswith("ipc://"):
        return None
    if Path(endpoint.removeprefix("ipc://")).parent.name != "run":
        return None
    return process_credential(state_dir_of(endpoint))


def authenticate(sock: zmq.Socket[bytes], state_dir: StateDir,
                 credential: Credential | None = None) -> None:
    """Present `credential` (default: this process's own) on a socket of one's
    own making (tools, benchmarks, tests); call before connect()."""
    apply_client(sock, credential or process_credential(state_dir))


def stand_in_server(ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes],
                    state_dir: StateDir) -> ZapHandler:
    """Make `sock` (not yet bound) authenticate like the runtime's servers, with a
    ZAP thread: for a test or benchmark standing in for the supervisor."""
    zap = ZapHandler(ctx, ensure_keys(state_dir))
    apply_server(sock)
    zap.serve_in_thread()
    return zap


def state_dir_of(endpoint: str) -> StateDir:
    """The state directory of an `ipc://<dir>/run/<name>.sock` endpoint (else ./.corral)."""
    if endpoint.startswith("ipc://"):
        return StateDir(Path(endpoint.removeprefix("ipc://")).parent.parent)
    return StateDir.at(None)


def _read_fd(fd_text: str) -> Credential:
    try:
        fd = int(fd_text)
    except ValueError as exc:
        raise AuthError(f"{ENV_CREDENTIAL_FD} is not an fd number") from exc
    return read_credential(fd)


def read_credential(fd: int) -> Credential:
    """Read a credential from the pipe `fd` to its end, and close it."""
    data = b""
    try:
        while len(data) <= _MAX_CREDENTIAL_BYTES and (chunk := os.read(fd, 1024)):
            data += chunk
    except OSError as exc:
        raise AuthError(f"cannot read the credential fd {fd}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return Credential.decode(data)


# --- sockets ----------------------------------------------------------------------
def apply_client(sock: zmq.Socket[bytes], credential: Credential) -> None:
    """Call before connect()."""
    sock.setsockopt(zmq.PLAIN_USERNAME, credential.name.encode())
    sock.setsockopt(zmq.PLAIN_PASSWORD, credential.secret)


def apply_server(sock: zmq.Socket[bytes]) -> None:
    """Call before bind(): every connection must authenticate (ZAP domain corral)."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def user_of(frame: zmq.Frame) -> str:
    """The authenticated name of the connection a received frame came from."""
    return str(frame.get(USER_ID))


class ZapHandler:
    """The ZAP handler of one context, served from its owner's loop: poll
    `socket` and call `handle()` (it never blocks). PLAIN: name + password
    against the keyring. CURVE: a public key in `authorized_dir` is the actor
    named by its file. Anything else is refused."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keyring: Keyring,
                 authorized_dir: Path | None = None) -> None:
        self.keyring = keyring
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self._curve: dict[bytes, str] = {}
        if authorized_dir is not None:
            for path in sorted(authorized_dir.glob("*.key")):
                public, _ = zmq.auth.load_certificate(path)
                if NAME_PATTERN.fullmatch(path.stem):
                    self._curve[public] = path.stem
        self.admitted_total = 0
        self.refused_total = 0
        self._window = 0.0
        self._budget = REFUSAL_LOGS_PER_S

    def handle(self) -> int:
        """Answer every waiting request; returns how many were answered."""
        answered = 0
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            self.socket.send_multipart(self._answer(frames))
            answered += 1

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500",
                    b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        user: str | None = None
        claimed = ""
        if mechanism == b"PLAIN" and len(credentials) == 2:
            claimed = credentials[0][:64].decode("ascii", "replace")
            if self.keyring.verify(claimed, credentials[1]):
                user = claimed
        elif mechanism == b"CURVE" and len(credentials) == 1:
            user = self._curve.get(zmq.utils.z85.encode(credentials[0]))
        if user is not None and domain == ZAP_DOMAIN:
            self.admitted_total += 1
            return [version, request_id, b"200", b"OK", user.encode(), b""]
        self.refused_total += 1
        self._log_refusal(mechanism, claimed, address)
        return [version, request_id, b"400", b"invalid credentials", b"", b""]

    def _log_refusal(self, mechanism: bytes, claimed: str, address: bytes) -> None:
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._budget = now, REFUSAL_LOGS_PER_S
        if self._budget <= 0:
            return
        self._budget -= 1
        # the address of an ipc peer is "localhost:<uid>:<gid>:<pid>" (SO_PEERCRED)
        log.warning("connection_refused", mechanism=mechanism.decode("ascii", "replace"),
                    claimed=claimed, peer=address[:80].decode("ascii", "replace"),
                    refused_total=self.refused_total)

    def serve_in_thread(self) -> None:
        """Answer from a daemon thread of its own, for a tool or test standing in
        for a server without a loop to poll in (the socket is the thread's from now)."""
        def run() -> None:
            with contextlib.suppress(zmq.ContextTerminated, zmq.ZMQError):
                while True:
                    if self.socket.poll(100):
                        self.handle()

        threading.Thread(target=run, name="zap", daemon=True).start()

    def close(self) -> None:
        self.socket.close(linger=0)


# --- what each identity may do ----------------------------------------------------
def append_refusal(user: str, stream: str, origin: str, event: str) -> str | None:
    """None when `user` may append `event` to `stream` under `origin`; else why not."""
    if user == OPERATOR:
        return None
    if event in OPERATOR_EVENTS:
        return f"{event} is an operator fact; {user} may not append it"
    if user == PROCS:
        if stream.startswith("procs/") and origin == stream:
            return None
    elif user == SUBAGENTS:
        if stream.startswith("subagents/") and origin == SUBAGENTS:
            return None
    elif user == AUTOMATION:
        if stream.startswith("automation/") and origin == AUTOMATION:
            return None
        if stream.startswith("agent/") and origin == AUTOMATION and event == "schedule_usage":
            return None  # a schedule's run charged to its owner (supervisor/automationgrants.py)
    elif user not in RESERVED and stream == f"agent/{user}" and origin == user:
        return None
    elif (user not in RESERVED and stream == "config/registries" and origin == user
          and event == "config_generation"):
        return None  # a registry op's generation fact (actors/registries/store.py)
    elif (user not in RESERVED and origin.startswith(f"{user}.pl-")
          and stream == f"agent/{origin}"):
        return None  # the agent's in-process pipeline runner (actors/pipelines/ops.py)
    return f"{user} may not append to {stream} under origin {origin}"


def name_refusal(user: str, name: str) -> str | None:
    """None when `user` may act under the actor name `name` (broker identity,
    `ready`/`heartbeat` on the control socket); else why not."""
    if user in (name, OPERATOR):
        return None
    return f"authenticated as {user}, not {name}"


def control_refusal(user: str, kind: str) -> str | None:
    """None when `user` may send a control request of `kind` to the supervisor."""
    if kind in ("status_request", "ready", "heartbeat", "ping", "stats_request") \
            or user == OPERATOR:
        return None
    return f"{kind} is an operator command; {user} is not the operator"
