"""``python -m fewerbits_runtime``: see ``fewerbits_runtime.cli``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
