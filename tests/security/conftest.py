"""Fixtures of the security tests (tests/security/stack.py)."""

from tests.security.stack import runtime, shared

__all__ = ["runtime", "shared"]
