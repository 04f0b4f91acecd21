"""Fleet state shared between the supervisor and the workers (see ``layout`` for the why).

``SHARED`` is set in the gunicorn master before it forks (``narwhal.master.gunicorn_hooks``); workers
and the supervisor inherit it. It stays None when the app runs outside gunicorn.

Its modules: the one memfd: ``layout.py`` (and ``Mapped``, how a region is created, mapped and
closed, for both memfds), ``records.py`` (records under a seqlock + CRC32, exact without x86
ordering; ring entries stamped with their index), ``shared.py`` (operations; slots claimed and
released under the claim lock), ``worker.py`` (a worker's lock-free view: re-reads until the records
carry the generation it saw), ``table.py`` (the engine table: an engine's slot follows its name and
URL across reloads; every per-engine record, count, report field and cap lock is keyed by it;
written by the master at reloads and, with discovery, by the supervisor at run time, one writer at a
time under the table lock), ``descriptors.py`` (an engine's ``[[engines]]`` entry as JSON at its
slot, for workers never told of it), ``models.py`` (each engine's models at its slot, bounded: names
of at most 255 bytes, at most 64 per engine, 2 KiB a record; the models generation), ``local.py``
(same interface, one process); ``holdings.py``, a memfd of its own (policy ``held``): each
producer's held block keys, seqlocked and CRC-checked, and a prefill ring per worker slot
(``holdings_view.py``: a worker's side of it, the sections it decodes again only when their sequence
moved, its ring and its work counters); ``column_sums.py`` (the per-engine sums of every slot's work
counters, reading only up to the highest slot in use)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from narwhal.shm.shared import SharedFleet

SHARED: SharedFleet | None = None
# The placement policy's own shared memory, when it asks for some (``PolicyRegion``): a memfd of
# its own, created by the master beside ``SHARED`` and inherited alike; None without.
POLICY_REGION: Any = None
