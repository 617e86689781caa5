"""Redacting what was typed into a terminal from what the terminal shows.

The model's terminal input may be a password; the agent keeps its text out
of the WAL (actors/kernel/vault.py), but a terminal echoes it (the tty's echo,
or a program such as `cat` printing it back). So procs removes it from the
PTY output *before* the output is written to the terminal's log, the only
place a `terminal_read` (the WAL's result, the model's context) or an
operator reads it from.

What counts as typed text: every line of an input (split at CR/LF, stripped
of surrounding blanks) of at least MIN_LINE_BYTES, and every word of a line
(split at blanks and quotes) of at least MIN_WORD_BYTES (a secret assigned
in a longer line, `x = 'hunter2'`, printed back alone). A line typed with
editing keys (backspace, ^W, ^U) counts also as the program reads it after
the tty's line editing (`cat` prints `Edit3d-Secret-999` for
`Edit3dX<DEL>-Secret-999`) and as the runs between the keys (the tty's echo).
Each occurrence in the output becomes MASK.

Across reads: output that ends with the beginning of a secret is held back
until the next bytes show whether the secret follows (then it is masked) or
not (then they pass), so a secret split over two reads of the PTY is masked
too. Held bytes are released after HOLD_S of silence (a prompt may end
with what happens to begin a secret) and at the end of the terminal.

Not covered (docs/security.md): output derived from the input (a program
printing it reversed, encoded, or one character at a time slower than
HOLD_S), and typed text shorter than the minimums.
"""

from __future__ import annotations

import re
import time

MASK = b"[redacted]"
MIN_LINE_BYTES = 4
MIN_WORD_BYTES = 6
MAX_SECRETS = 512  # per terminal, the newest kept
HOLD_S = 0.5
_WORD_SPLIT = re.compile(rb"[\s'\"`]+")
_BLANKS = frozenset(b" \t")
_EDIT_KEYS = re.compile(rb"[\x7f\x08\x15\x17]+")


def edited(line: bytes) -> bytes:
    """What the tty's line discipline hands a program for `line` typed with
    its editing keys: backspace (DEL, ^H) erases a byte, ^W a word, ^U the line."""
    out = bytearray()
    for byte in line:
        if byte in (0x7F, 0x08):
            del out[-1:]
        elif byte == 0x15:
            out.clear()
        elif byte == 0x17:
            while out and out[-1] in _BLANKS:
                out.pop()
            while out and out[-1] not in _BLANKS:
                out.pop()
        else:
            out.append(byte)
    return bytes(out)


def _pieces(line: bytes) -> list[bytes]:
    line = line.strip()
    found = [line] if len(line) >= MIN_LINE_BYTES else []
    return found + [w for w in _WORD_SPLIT.split(line) if len(w) >= MIN_WORD_BYTES and w != line]


def secrets_of(typed: bytes) -> list[bytes]:
    """The pieces of an input that must not come back out: each line as
    typed, as the program reads it after line editing (`edited`), and, for a
    line with editing keys, each run of bytes between them (what the tty
    echoes between its erasures)."""
    found: list[bytes] = []
    for raw in re.split(rb"[\r\n]+", typed):
        found += _pieces(raw)
        if _EDIT_KEYS.search(raw):
            found += _pieces(edited(raw))
            for run in _EDIT_KEYS.split(raw):
                found += _pieces(run)
    return list(dict.fromkeys(found))


class Redactor:
    """One terminal's output filter."""

    def __init__(self) -> None:
        self._secrets: dict[bytes, None] = {}  # insertion-ordered set
        self._pattern: re.Pattern[bytes] | None = None
        self._held = b""
        self._held_at = 0.0

    def add(self, typed: bytes) -> None:
        """Remember what was typed (before it is written to the PTY)."""
        for secret in secrets_of(typed):
            self._secrets.pop(secret, None)
            self._secrets[secret] = None
        while len(self._secrets) > MAX_SECRETS:
            del self._secrets[next(iter(self._secrets))]
        if self._secrets:
            longest_first = sorted(self._secrets, key=len, reverse=True)
            self._pattern = re.compile(b"|".join(re.escape(s) for s in longest_first))

    def feed(self, data: bytes) -> bytes:
        """The output to pass on now; the possible beginning of a secret at
        the end is held back."""
        if self._pattern is None:
            return data
        buf = self._pattern.sub(MASK, self._held + data)
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else b""
        if keep:
            self._held_at = time.monotonic()
        return buf[: len(buf) - keep]

    def due(self) -> bytes:
        """Held bytes whose wait is over (HOLD_S without more output)."""
        if self._held and time.monotonic() - self._held_at >= HOLD_S:
            return self.flush()
        return b""

    def flush(self) -> bytes:
        """Release what is held (the end of the output)."""
        held, self._held = self._held, b""
        return held

    def _partial_tail(self, buf: bytes) -> int:
        """The length of the longest end of `buf` that is a proper beginning
        of a secret."""
        best = 0
        for secret in self._secrets:
            start = max(0, len(buf) - (len(secret) - 1))
            pos = buf.find(secret[:1], start)
            while pos != -1 and len(buf) - pos > best:
                if secret.startswith(buf[pos:]):
                    best = len(buf) - pos  # the earliest match is the longest
                    break
                pos = buf.find(secret[:1], pos + 1)
        return best
