"""`python -m supervisor.console`: `supervisor console`.

See docs/console.md.
"""

import sys

from supervisor.console.serve import main

sys.exit(main())
