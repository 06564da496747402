"""`python -m edge0.run` is `edge0 run`: generate text (the built-in demo model by default).

    python -m edge0.run --prompt "def fib(n):" --max-tokens 32
"""

import sys

from edge0.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
