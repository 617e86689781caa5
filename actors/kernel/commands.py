"""Reading a shell command line into simple commands for the command rules.

A convenience, not a boundary (the sandbox is). A line whose command cannot
be read from its text is opaque (None) and matches every deny and ask rule
and no allow rule. See docs/agents.md ("The gate").
"""

from __future__ import annotations

import re
import shlex

SEPARATORS = frozenset({";", "&&", "||", "|", "&", "|&", ";;", "(", ")", "\n", ";&", ";;&"})
KEYWORDS = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "while", "until",
                      "!", "{", "}", "time", "coproc"})
# wrappers: (name, options that take a value, positional arguments before the command)
WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "env": (frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}), 0),
    "command": (frozenset(), 0), "builtin": (frozenset(), 0), "exec": (frozenset({"-a"}), 0),
    "nohup": (frozenset(), 0), "setsid": (frozenset(), 0), "sudo": (frozenset(
        {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U"}), 0),
    "doas": (frozenset({"-u", "-C"}), 0), "xargs": (frozenset(
        {"-a", "-d", "-E", "-e", "-I", "-i", "-L", "-l", "-n", "-P", "-s"}), 0),
    "nice": (frozenset({"-n", "--adjustment"}), 0), "ionice": (frozenset({"-c", "-n", "-p"}), 0),
    "timeout": (frozenset({"-s", "--signal", "-k", "--kill-after"}), 1),
    "stdbuf": (frozenset({"-i", "-o", "-e"}), 0), "chrt": (frozenset(), 1),
    "taskset": (frozenset(), 1), "busybox": (frozenset(), 0), "unbuffer": (frozenset(), 0),
    "flock": (frozenset({"-w", "-E", "-c"}), 1), "chroot": (frozenset(), 1),
    "watch": (frozenset({"-n", "-d"}), 0), "strace": (frozenset({"-o", "-e", "-p"}), 0),
}
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "fish", "busybox-sh"})
OPAQUE_NAMES = frozenset({"eval", "source", ".", "trap", "alias"})
_SUBSTITUTION = re.compile(r"\$\(|`|<\(|>\(")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=")
_REDIRECT = re.compile(r"^[0-9]*(<|>|<<|>>|<&|>&|&>|&>>|<>|>\||<<<)$")
MAX_DEPTH = 4


def _tokens(line: str) -> list[str] | None:
    lexer = shlex.shlex(line.replace("\r", "\n").replace("\n", " ; "), posix=True,
                        punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes
        return None


def _split(tokens: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for token in tokens:
        if token in SEPARATORS:
            out.append([])
        else:
            out[-1].append(token)
    return [words for words in out if words]


def _strip(words: list[str]) -> list[str] | None:
    """The words of the command that actually runs (None: opaque)."""
    i = 0
    while i < len(words):
        word = words[i]
        if word in KEYWORDS or _ASSIGNMENT.match(word):
            i += 1
        elif _REDIRECT.match(word):
            i += 2  # the operator and its target
        elif word.isdigit() and i + 1 < len(words) and _REDIRECT.match(words[i + 1]):
            i += 3
        else:
            name = word.rsplit("/", 1)[-1] if "/" in word.rstrip("/") else word
            wrapper = WRAPPERS.get(name)
            if wrapper is None:
                if "$" in word or name in OPAQUE_NAMES:
                    return None
                return [name, *words[i + 1:]]
            takes_value, positional = wrapper
            i += 1
            while i < len(words) and (words[i].startswith("-") or (
                    name == "env" and _ASSIGNMENT.match(words[i]))):
                i += 2 if words[i] in takes_value else 1
            i += positional
    return []


def simple_commands(line: str, _depth: int = 0) -> list[list[str]] | None:
    """Each simple command of `line` as its normalised words; None if opaque."""
    if _SUBSTITUTION.search(line) or _depth > MAX_DEPTH:
        return None
    tokens = _tokens(line)
    if tokens is None:
        return None
    out: list[list[str]] = []
    for words in _split(tokens):
        stripped = _strip(words)
        if stripped is None:
            return None
        if not stripped:
            continue
        if stripped[0] in SHELLS and "-c" in stripped[1:]:
            inner_at = stripped.index("-c") + 1
            if inner_at >= len(stripped):
                return None
            inner = simple_commands(stripped[inner_at], _depth + 1)
            if inner is None:
                return None
            out.extend(inner)
            continue
        out.append(stripped)
    return out


def rule_words(prefix: str) -> list[str]:
    """A rule's command prefix as normalised words (its first word without a path)."""
    words = simple_commands(prefix)
    if words:
        return words[0]
    return prefix.split()


def starts_with(words: list[str], prefix: list[str]) -> bool:
    return bool(prefix) and words[: len(prefix)] == prefix
