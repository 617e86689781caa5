"""One program on a PTY: pumped to its log, capped, redacted, typed once.

See docs/procs.md ("Terminals", "A full disk").
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections import OrderedDict

from actors.procs.job import Job, state_for
from actors.procs.redact import Redactor
from actors.procs.registry import Entry

READ_CHUNK = 64 * 1024
PUMP_BUDGET_BYTES = 1024 * 1024  # per terminal per turn of the loop (fairness)
MAX_PENDING_INPUT = 256 * 1024
INPUT_IDS_KEPT = 256
EIO_WAIT_S = 2.0  # after the program exits, how long a held slave may delay the end
MAX_UNWRITTEN_BYTES = 1024 * 1024  # output held while the log's disk is full
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class InputRefusedError(Exception):
    """The terminal cannot take more input now (ended, or its queue is full)."""


class Terminal(Job):
    def __init__(self, entry: Entry, master_fd: int | None, *, kill_grace_s: float) -> None:
        super().__init__(entry, ours=master_fd is not None, kill_grace_s=kill_grace_s)
        self.master_fd = master_fd
        self.log_fd: int | None = None
        self.written = 0
        self.unwritten = bytearray()  # kept output the full disk did not take yet
        self.disk_full: str | None = None  # the error while the log cannot be written
        self.dropped = 0  # bytes given up at the end (the disk never had room)
        self.eof = master_fd is None
        self.reaped_at: float | None = None
        self._pending = bytearray()
        self._inputs: OrderedDict[str, None] = OrderedDict()
        self.redactor = Redactor()
        if master_fd is not None:
            self.log_fd = os.open(
                entry.log_path,
                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            self.written = os.fstat(self.log_fd).st_size

    def pump(self) -> int:
        """Move what the program wrote into the log (typed text redacted);
        returns bytes read."""
        total = 0
        self._write_out()
        while (self.master_fd is not None and not self.eof and total < PUMP_BUDGET_BYTES
               and len(self.unwritten) < MAX_UNWRITTEN_BYTES):
            try:
                data = os.read(self.master_fd, READ_CHUNK)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                data = b""  # Linux: EIO once the slave is closed and drained
            if not data:
                self.eof = True
                self._keep(self.redactor.flush())
                break
            total += len(data)
            self._keep(self.redactor.feed(data))
        if not total:
            self._keep(self.redactor.due())  # held back, and nothing followed
        self._flush_input()
        return total

    def _keep(self, data: bytes) -> None:
        """Append to the log up to the cap; past it, end the tree."""
        if not data:
            return
        room = self.entry.cap_bytes - self.written - len(self.unwritten)
        if room > 0 and self.log_fd is not None:
            self.unwritten += data[:room]
            self._write_out()
        if len(data) > room and self.running:
            self.kill("cap")

    def _write_out(self) -> None:
        """Write the held bytes to the log; on a full disk keep them (retried
        at every pump) and say so in `disk_full`."""
        while self.unwritten and self.log_fd is not None:
            try:
                n = os.write(self.log_fd, self.unwritten)
            except OSError as exc:
                if exc.errno not in DISK_FULL_ERRNOS:
                    raise
                self.disk_full = f"{self.entry.log_path}: {os.strerror(exc.errno)}"
                return
            del self.unwritten[:n]
            self.written += n
        self.disk_full = None

    def typed(self, input_id: str) -> bool:
        """Whether the input sent under `input_id` was already taken."""
        return input_id in self._inputs

    def send(self, data: bytes, input_id: str) -> None:
        """Queue input for the program (written as the PTY takes it), once per
        `input_id`."""
        if input_id in self._inputs:
            return
        if not self.running or self.master_fd is None:
            raise InputRefusedError(f"terminal {self.proc_id} is {self.entry.state}")
        if len(self._pending) + len(data) > MAX_PENDING_INPUT:
            raise InputRefusedError(f"terminal {self.proc_id}: input queue full")
        self.redactor.add(data)  # before the PTY can echo it
        self._pending += data
        self._inputs[input_id] = None
        if len(self._inputs) > INPUT_IDS_KEPT:
            self._inputs.popitem(last=False)
        self._flush_input()

    def _flush_input(self) -> None:
        while self._pending and self.master_fd is not None and self.running:
            try:
                n = os.write(self.master_fd, self._pending)
            except (BlockingIOError, OSError):
                return
            del self._pending[:n]

    def refresh(self) -> bool:
        """Cap/lifetime/escalation; settle once reaped and drained (or the
        drain waited EIO_WAIT_S). Returns True when an end state was reached."""
        if not self.running:
            return False
        if not self.leader_gone():
            if self.expired():
                self.kill("lifetime")
            elif self.quota is not None and self.quota.exceeded():
                self.kill("quota")
            self.escalate()
            return False
        if self.reaped_at is None:
            self.reaped_at = time.monotonic()
        self.pump()
        if not self.eof and time.monotonic() - self.reaped_at < EIO_WAIT_S:
            return False  # a descendant still holds the slave: wait for the drain
        if not self.eof:
            self.kill(self.entry.kill_reason or "request")  # end the holders, then close
        if self.log_fd is not None:
            self._keep(self.redactor.flush())
        if self.unwritten and not self.expired():
            return False  # the disk is full: end once the output is in the log
        self.close_fds()
        if self.wait_status is not None:
            self.entry.exit_code = os.waitstatus_to_exitcode(self.wait_status)
        reason = self.entry.kill_reason
        self.entry.state = state_for(reason) if reason is not None else "exited"
        return True

    def close_fds(self) -> None:
        if self.log_fd is not None:
            self._keep(self.redactor.flush())
        self.dropped += len(self.unwritten)  # only at the lifetime or a stop of procs
        self.unwritten.clear()
        for fd in (self.master_fd, self.log_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.master_fd = self.log_fd = None
        self.eof = True
