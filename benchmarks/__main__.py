"""``python -m benchmarks [options]``: the benchmark (see :mod:`benchmarks.run`).

Run from the repository root of a checkout; benchmarks/ is not part of the
wheel.
"""

import sys

from benchmarks import run

if __name__ == "__main__":
  sys.exit(run.main())
