"""`supervisor`: corral's operator command line, one module per command or group.

supervisor/cli/main.py parses and dispatches; each command module declares
its commands in `COMMANDS` (supervisor/cli/command.py). Nothing is imported
here. See docs/supervisor.md ("Code layout").
"""
