"""Entry point of ``python -m perf`` (kept tiny so ``perf.main`` stays importable in tests)."""

import sys

from perf.main import main

if __name__ == "__main__":
    sys.exit(main())
