"""`python -m edge0.cli` is the `edge0` console script."""

import sys

from edge0.cli import main

if __name__ == "__main__":
    sys.exit(main())
