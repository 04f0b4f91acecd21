"""``python -m perf.chaos``: the suite's command line (``perf.chaos.run``)."""

import sys

from perf.chaos.run import main

sys.exit(main())
