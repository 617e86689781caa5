"""`python -m actors.writer --state-dir D`: the writer process.

See actors/writer/process.py and docs/wal.md.
"""

from __future__ import annotations

import sys

from actors.writer.process import main

if __name__ == "__main__":
    sys.exit(main())
