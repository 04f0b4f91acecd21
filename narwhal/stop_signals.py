"""The signals by which gunicorn's master stops its workers (its ``kill_workers``).

The master blocks them while it forks a worker, and each worker unblocks them once its own
handlers are set (``master.arbiter``, ``worker.lifecycle``): a base module, so that neither
process's package imports the other's.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGQUIT, signal.SIGINT})
