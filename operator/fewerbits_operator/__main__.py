"""``python -m fewerbits_operator``: run the controller (runner.Operator) until SIGTERM."""

from __future__ import annotations

import logging
import sys

from .runner import Operator


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Operator().run()


if __name__ == "__main__":
    sys.exit(main())
