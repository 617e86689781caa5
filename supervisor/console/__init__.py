"""The web console: `supervisor console [--listen 127.0.0.1:PORT]`.

A Starlette application in a process of its own; nothing else imports this
package. See docs/console.md.
"""
