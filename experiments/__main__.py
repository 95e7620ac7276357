"""`python -m experiments NAME [args...]`: run experiment NAME; alone or with --list, list them."""

import sys

from benchmarks import runner

if __name__ == "__main__":
    sys.exit(runner.main("experiments"))
