"""Fleet state shared between the supervisor and the workers (see ``layout`` for the why).

``SHARED`` is set in the gunicorn master before it forks (``narwhal.master.gunicorn_hooks``); workers
and the supervisor inherit it. It stays None when the app runs outside gunicorn.

Its modules:

- ``layout.py``: the one memfd's layout, and ``Mapped``: how a region is created, mapped, closed
- ``records.py``: records under a seqlock and CRC32, exact without x86 ordering; stamped ring entries
- ``shared.py``: ``SharedFleet``, the operations; slots claimed and released under the claim lock
- ``worker.py``: a worker's lock-free view: re-reads until the records carry the generation it saw
- ``local.py``: the same interface in one process, without gunicorn
- ``table.py``: the engine table: an engine's slot follows its name and URL across reloads
- ``descriptors.py``: an engine's ``[[engines]]`` entry as JSON at its slot
- ``models.py``: each engine's models at its slot, bounded; the models generation
- ``column_sums.py``: per-engine sums of every slot's counters, up to the highest slot in use
- ``holdings.py``: policy ``held``'s region, a memfd of its own: sections, prefill rings, work
- ``holdings_view.py``: a worker's side of the holdings region
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from narwhal.shm.shared import SharedFleet

SHARED: SharedFleet | None = None
# The placement policy's own shared memory, when it asks for some (``PolicyRegion``): a memfd of
# its own, created by the master beside ``SHARED`` and inherited alike; None without.
POLICY_REGION: Any = None
