"""``python -m rfopt.cli``: the ``rfopt`` command, as the console script runs it."""

import sys

from rfopt.cli.program import main

if __name__ == "__main__":
    sys.exit(main())
