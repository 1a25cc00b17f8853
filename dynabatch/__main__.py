"""``python -m dynabatch COMMAND``: the command line of :mod:`dynabatch.cli` (``embed``, ``generate``, ``calibrate``)."""

import sys

from dynabatch.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
