"""`python -m supervisor.cli`: the `supervisor` command (supervisor/cli/main.py)."""

import sys

from supervisor.cli.main import main

sys.exit(main())
