"""`python -m actors.writer --state-dir D`: the writer process (see
`actors.writer.process`)."""

from __future__ import annotations

import sys

from actors.writer.process import main

if __name__ == "__main__":
    sys.exit(main())
