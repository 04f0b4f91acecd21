"""A worker's engines' models, followed from shared memory: the supervisor reads them, a worker never.

The supervisor reads every engine's ``/v1/models`` (``supervisor.models``) and publishes one
record per engine slot (``shm.models``). A worker takes them into its fleet (``Fleet.set_models``,
which moves ``fleet.version``: placement's per-model caches follow it), and admission and
``/v1/models`` read the fleet as before: a set lookup per request, nothing more.

Invariants:

* Nothing per request: :meth:`ModelsFollower.check` runs every :data:`FOLLOW_S` on the worker's
  loop and compares one u64, the models generation, and the fleet's engine list (discovery
  rebuilds it, ``worker.roster_follow``); only when either moved are the records decoded.
* A generation is taken as seen only once every record it needs carries it (on aarch64 the
  bump can be seen before a record: ``shm.records``); until then the next check reads again.
* A worker starts serving once the supervisor's first read of each of its engines ended
  (answered or not), bounded by :data:`START_WAIT_S`, as it did when it read them itself: a
  worker's first request does not find a model missing that the engines serve.
* ``engines[].models``, when set, is never replaced; a record of another engine (before a
  reload, or a slot discovery gave to another) is nobody's: no models from it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from narwhal import shm
from narwhal.fleet import Engine, Fleet
from narwhal.shm import models as M
from narwhal.shm.records import RecordBusy
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import LIVE, record_hash
from narwhal.worker import following

log = logging.getLogger("narwhal.worker.models")

START_WAIT_S = M.READ_TIMEOUT_S + 3.0  # the supervisor's first read, and its start beside ours
_START_POLL_S = 0.02


def for_worker(fleet: Fleet, *, by_slot: bool) -> ModelsFollower | None:
    """The worker's follower (``by_slot``: the fleet follows the engine table, each index its
    slot); None outside gunicorn, with no supervisor: there only ``engines[].models`` count."""
    return None if shm.SHARED is None else ModelsFollower(shm.SHARED, fleet, by_slot=by_slot)


class ModelsFollower:
    """Keeps the fleet's models the supervisor's; one u64 compare per check when nothing moved."""

    def __init__(self, shared: SharedFleet, fleet: Fleet, *, by_slot: bool) -> None:
        self.shared = shared
        self.fleet = fleet
        self._by_slot = by_slot
        self._seen = -1
        self._engines: list[Engine] | None = None

    def _slot(self, engine: Engine) -> int | None:
        return engine.index if self._by_slot else self.shared.engine_slot(engine.name, engine.url)

    def _records(self) -> tuple[list[tuple[Engine, int, M.ModelsRecord | None]], bool]:
        """Each engine's record (an engines[].models one too: its version), and whether all were readable."""
        out: list[tuple[Engine, int, M.ModelsRecord | None]] = []
        whole = True
        for engine in self.fleet.engines:
            slot = self._slot(engine)
            if slot is None:
                continue
            try:
                out.append((engine, slot, M.read_models(self.shared.region, slot)))
            except RecordBusy:
                whole = False  # mid-write: read again at the next check
        return out, whole

    def check(self) -> None:
        """Take up a moved generation or engine list: the records into the fleet's models."""
        generation = M.generation(self.shared.region)
        engines = self.fleet.engines
        if generation == self._seen and engines is self._engines:
            return
        found, complete = self._records()
        for engine, slot, rec in found:
            behind = rec is None or rec.version < generation
            if behind and generation and self.shared.table.entry(slot).state == LIVE:
                complete = False  # the bump was seen before this record (shm.records); a retired slot's
                # record is written no more
            engine.models_read = False
            if rec is None:
                models: frozenset[str] = frozenset()
            elif rec.name_hash == record_hash(engine.name, engine.url):
                models = frozenset(rec.models)
                engine.models_read = rec.status != M.PENDING  # /admin/engines: "admitted" only from then
                if rec.engine_version is not None:  # docs/decisions.md "vLLM releases": which engines may pair
                    self.fleet.set_version(engine, rec.engine_version, say=False)  # the supervisor said it
                engine.generate_refused = rec.generate == M.GENERATE_REFUSED  # shown by /admin/engines
                self.fleet.set_context(engine, rec.max_model_len)  # the router's /v1/models; admission's bound
                engine.model_root = (rec.models[0], rec.root) if rec.models and rec.root else None
            elif behind:
                continue  # another engine's record, not rewritten for this one yet: keep what it had
            else:
                models = frozenset()  # the supervisor publishes no record for this engine
            if models != engine.models and not engine.models_configured:
                self.fleet.set_models(engine, models, say=False)  # the supervisor said it
        if complete:
            self._seen, self._engines = generation, engines

    def unread(self) -> list[str]:
        """The engines whose first read by the supervisor has not ended yet."""
        found, _ = self._records()
        return [engine.name for engine, _, rec in found if not engine.models_configured and (
                rec is None or rec.status == M.PENDING or rec.name_hash != record_hash(engine.name, engine.url))]

    async def first(self, bound_s: float = START_WAIT_S) -> None:
        """Wait (bounded) until the supervisor has read every engine once, then take the models up."""
        end = time.monotonic() + bound_s
        while (waiting := self.unread()) and time.monotonic() < end:
            await asyncio.sleep(_START_POLL_S)
        if waiting:
            log.warning("the supervisor has not read the models of %s yet: serving without them until it does",
                        ", ".join(waiting))
        self.check()

    async def keep_following(self) -> None:
        """:meth:`check` every ``FOLLOW_S`` until cancelled (:mod:`narwhal.worker.following`)."""
        await following.keep_following(self.check, "the engines' models")
