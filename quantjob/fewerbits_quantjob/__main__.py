"""``python -m fewerbits_quantjob``: run the quantization Job from its contract in the environment."""

import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())
