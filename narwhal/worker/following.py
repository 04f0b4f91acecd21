"""How a worker follows what the supervisor publishes in shared memory (the engine table, the
engines' models): a cheap check every :data:`FOLLOW_S` on the worker's own loop, never per request.

Invariant: a check that raises is logged and the next one runs: a worker never stops following,
so it cannot drift from the supervisor's view for longer than one failing period."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("narwhal.worker")

FOLLOW_S = 0.25  # a change is taken up within this of the supervisor's publish


async def keep_following(check: Callable[[], None], what: str) -> None:
    """Run ``check`` every :data:`FOLLOW_S` until cancelled; ``what`` names it in the log."""
    while True:
        await asyncio.sleep(FOLLOW_S)
        try:
            check()
        except Exception:  # never let the following stop
            log.exception("following %s failed", what)
