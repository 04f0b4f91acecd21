"""Fleet state shared between the supervisor and the workers (see ``layout`` for the why).

``SHARED`` is set in the gunicorn master before it forks (``narwhal.master.gunicorn_hooks``); workers
and the supervisor inherit it. It stays None when the app runs outside gunicorn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from narwhal.shm.holdings import Holdings
    from narwhal.shm.shared import SharedFleet

SHARED: SharedFleet | None = None
HOLDINGS: Holdings | None = None  # placement.policy "held" only: its own memfd (narwhal.shm.holdings)
