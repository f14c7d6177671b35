"""``python -m fewerbits_quantjob``: run the quantization Job from its contract in the environment.

``python -m fewerbits_quantjob canary``: the serving canary's evaluation (canary.py) instead."""

import sys

from .job import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["canary"]:
        from .canary import main as canary_main

        sys.exit(canary_main(sys.argv[2:]))
    sys.exit(main())
