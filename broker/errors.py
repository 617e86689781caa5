"""The project's exception tree: one root, a few branches, each carrying what an
operator needs to act on it.

    CorralError
     ├── ProtocolError            a frame or message was refused (carries `code`)
     ├── ConfigError              a configuration file or value is invalid
     ├── StateDirError            the state directory is unusable
     │    └── LockHeldError       another process holds the state directory
     ├── WalError                 the WAL cannot be used
     │    └── WalCorruptionError  damage before the tail (file + byte offset)
     ├── DurabilityError          a write or fdatasync failed; nothing was acked
     ├── RequestTimeoutError      a peer did not answer within the deadline
     ├── AuthRefusedError         the server refused this connection's handshake
     ├── RemoteError              a peer answered with a typed error reply
     ├── SpawnError               a child process could not be started
     ├── PathRefusedError         an agent's op named a path outside its workspace
     ├── ModelError               a model backend failed (after its retries)
     └── ChangeSetRefusedError    a change set was refused: the bound or rule hit
"""

from __future__ import annotations

from pathlib import Path


class CorralError(Exception):
    """Root of every error corral raises on purpose."""


class ProtocolError(CorralError):
    """A frame failed a protocol check; `code` is one of protocol.ErrorCode.
    `msg_id` is the refused frame's msg_id when it could be read (for the
    error reply), else None."""

    def __init__(self, code: str, detail: str, msg_id: str | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.msg_id = msg_id


class ConfigError(CorralError):
    """A configuration file or value is invalid."""


class StateDirError(CorralError):
    """The state directory cannot be used (permissions, missing parts)."""


class LockHeldError(StateDirError):
    """Another live process holds the lock on the state directory."""

    def __init__(self, lock_path: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "an unknown process"
        super().__init__(f"{lock_path} is held by {who}")
        self.lock_path = lock_path
        self.pid = pid


class WalError(CorralError):
    """The WAL cannot be opened or used."""


class WalCorruptionError(WalError):
    """A record before the tail is damaged; the WAL must not be used as is."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"WAL corrupt at {path} byte {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class DurabilityError(CorralError):
    """A write or fdatasync failed; nothing in the batch was acknowledged."""


class RequestTimeoutError(CorralError):
    """A request got no answer within its deadline (after any retries)."""


class AuthRefusedError(CorralError):
    """The server refused the ZMTP handshake (no, wrong or unknown credentials;
    docs/protocol.md, Authentication): resending with the same credentials
    cannot help. `event` names the socket monitor's event
    (`HANDSHAKE_FAILED_AUTH`, `HANDSHAKE_FAILED_NO_DETAIL`, ...)."""

    def __init__(self, endpoint: str, event: str, value: int) -> None:
        super().__init__(f"{endpoint} refused the handshake ({event}, {value}): "
                         "check the credential this client presents")
        self.endpoint = endpoint
        self.event = event
        self.value = value


class RemoteError(CorralError):
    """The peer answered with a typed error reply."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class SpawnError(CorralError):
    """A child process could not be started."""


class PathRefusedError(CorralError):
    """An op's path escapes the agent's workspace or hits the write-gate."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"path {path!r} refused: {reason}")
        self.path = path
        self.reason = reason


class ModelError(CorralError):
    """A model backend could not produce a reply (after its retries)."""


class ChangeSetRefusedError(CorralError):
    """A change set cannot be built or applied; `bound` names the limit or rule
    (max_files, max_input_bytes, max_patch_bytes, unsafe_path, symlink, stale,
    already_applied, not_ready, ...), `path` the file concerned if any."""

    def __init__(self, bound: str, detail: str, path: str | None = None) -> None:
        super().__init__(f"{bound}: {detail}")
        self.bound = bound
        self.detail = detail
        self.path = path
