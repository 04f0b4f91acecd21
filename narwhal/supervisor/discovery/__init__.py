"""Discovery in the supervisor (docs/behaviour.md "Engines that come and go"): read the sources, follow them through
shared memory.

Every ``discovery.interval_s`` the sources are read in a task of their own — the file in a
daemon thread and each DNS name, both bounded by the interval (at most 5 s) — so no read delays
the loop's heartbeat, and a read that hangs holds up no other source; the
loop only starts the read (:meth:`Discovery.tick`) and, once it finished, applies the result
(:meth:`Discovery.apply`: table and record writes, microseconds).

* **The last good set per source.** A source that cannot be read (``SourceUnreadable``: the
  file gone or not parsing, the DNS server not answering) or answers wrongly (``SourceInvalid``:
  the file refused as a whole, the line naming entry and key) keeps what it last said; one
  warning per source per minute (a new reason is said at once). At start, a source's last good
  set is what the table holds from it (a restarted supervisor, or one started by a reload, drains
  nothing its predecessor had found just because its first read fails).
* **The wanted fleet** is ``supervisor.discovery.wanted.wanted_fleet``: static first, then the file, then each
  DNS name in order; engines serving now before newcomers; a taken name or no slot left refused,
  the refusals logged once per change of what is refused.
* **Joining**: under the table lock, a slot is chosen, the engine's descriptor written there
  (``shm.descriptors``), the supervisor takes it up PROBING (``supervisor.membership``) and publishes its
  record, and only then does the table entry turn LIVE and the epoch move: a worker that takes it
  up (``worker.roster_follow``) finds its description and a record saying "not yet".
* **Leaving**: an engine no source names any more is DRAINING (no new legs; in-flight legs
  finish; a handoff nobody decodes is released by the request that made it, as always). Once no
  worker holds a leg on it for two sweeps in a row it is forgotten: its slot retired (the epoch
  moves), its breaker and its metric series removed. An engine named again while draining is
  readmitted.

Left as it is: a worker's outcome report still unread in its ring when that worker lets go of a
forgotten engine's slot, and the slot given to a new engine before the next drain (20 ms), would
be charged to the new engine; it takes the slot's reuse within one drain of the worker's last leg
there, and costs one report.

``narwhal_discovery_engines{source,state}``: by source (``file``, ``dns``) the engines found that
are ``active`` (in the fleet, not probing or draining), ``probing`` (not yet through their first
checks), ``draining`` (gone from the source, legs still finishing) and ``refused`` (a taken name,
or no engine slot left).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from narwhal import metrics
from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec
from narwhal.shm import descriptors
from narwhal.shm.layout import TABLE_LOCK
from narwhal.shm.table import TableFull, identity
from narwhal.supervisor.breaker import State
from narwhal.supervisor.discovery.sources import DnsReader, FileReader, SourceInvalid, SourceUnreadable
from narwhal.supervisor.discovery.wanted import STATIC, Member, change, wanted_fleet

if TYPE_CHECKING:
    from narwhal.supervisor.main import Supervisor

log = logging.getLogger("narwhal.discovery")

WARN_EVERY_S = 60.0
STATES = ("active", "probing", "draining", "refused")


class _NotYet(Exception):
    """A discovered engine the table cannot take yet, for a reason that will pass (its name held)."""


def gauge_source(source: str) -> str:
    """The ``source`` label of the discovery gauge: every DNS name counts as ``dns``."""
    return "dns" if source.startswith("dns:") else source


class Discovery:
    """docs/behaviour.md "Engines that come and go" in the supervisor: sources read off the loop, their last good sets
    applied to the table.
    """

    def __init__(self, sup: Supervisor, settings: Settings) -> None:
        self.sup = sup
        self.settings = settings.discovery
        self.static = list(settings.engines)
        self.order = (["file"] if self.settings.file else []) + [f"dns:{d.name}" for d in self.settings.dns]
        bound_s = min(self.settings.interval_s, 5.0)
        self._dns = DnsReader(self.settings, bound_s) if self.settings.dns else None
        self._file = FileReader(self.settings.file, bound_s) if self.settings.file else None
        by_source: dict[str, list[EngineSpec]] = {source: [] for source in self.order}
        for engine in sup.fleet.engines:  # what the table holds from each source: its last good set
            source = sup.sources.get(engine.name, STATIC)
            if source in by_source:
                by_source[source].append(_spec_of(sup, engine.name))
        self.last_good = by_source
        self._warned: dict[str, tuple[float, str]] = {}
        self._task: asyncio.Task[None] | None = None
        self._next_read = 0.0
        self._fresh = True  # apply once at start: the table's set against the static entries
        self._refused: list[str] = []
        self._refused_by_source: dict[str, int] = {}
        # URL -> the line said: engines the table could not take yet (no spare slot, or their name
        # still held by a draining engine); applied again every interval until they join.
        self._deferred: dict[str, str] = {}
        self.draining: dict[str, int] = {}  # engine -> sweeps seen with no leg on it

    # -- reading -------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """From the loop: start the next read when due (never two at once); apply what came."""
        if self._task is None and now >= self._next_read:
            self._next_read = now + self.settings.interval_s
            self._task = asyncio.ensure_future(self._read_all())
            self._task.add_done_callback(self._read_done)
            if self._deferred or self._refused:
                self._fresh = True  # a slot or a name may have freed meanwhile
        if self._fresh:
            self._fresh = False
            try:
                self.apply()
            except Exception:  # a defect here must not stop the supervisor (it would restart, and read the same)
                log.exception("discovery: applying the sources failed; the fleet stays as it was")

    def _read_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("discovery: reading the sources failed: %r", task.exception())

    async def _read_all(self) -> None:
        for source in self.order:
            try:
                if source == "file":
                    assert self._file is not None
                    found = await self._file.read()
                else:
                    assert self._dns is not None
                    dns = next(d for d in self.settings.dns if f"dns:{d.name}" == source)
                    found = await self._dns.read(dns)
            except (SourceUnreadable, SourceInvalid) as exc:
                self._warn(source, exc)
                continue
            except Exception as exc:  # whatever a source sends, the others are still read
                self._warn(source, SourceInvalid(f"{type(exc).__name__}: {exc}"))
                continue
            self._warned.pop(source, None)
            if [s.model_dump() for s in found] != [s.model_dump() for s in self.last_good.get(source, [])]:
                self.last_good[source] = found
                self._fresh = True

    def _warn(self, source: str, exc: Exception) -> None:
        now = time.monotonic()
        why = str(exc)
        last = self._warned.get(source)
        if last is None or last[1] != why or now - last[0] >= WARN_EVERY_S:
            self._warned[source] = (now, why)
            kept = len(self.last_good.get(source, []))
            kind = "refused" if isinstance(exc, SourceInvalid) else "unreadable"
            log.warning("discovery: %s %s, keeping its last good set (%d engines): %s", source, kind, kept, why)

    # -- applying ------------------------------------------------------------------------------

    def apply(self) -> None:
        """The wanted fleet against the current one: the gone drained, those named again readmitted, the new joined."""
        sup = self.sup
        current = {e.url for e in sup.fleet.engines}
        wanted = wanted_fleet(self.static, {s: self.last_good.get(s, []) for s in self.order}, current,
                              sup.shared.layout.engines)
        if wanted.refused != self._refused:
            for line in wanted.refused:
                log.warning("%s", line)
        self._refused, self._refused_by_source = wanted.refused, dict(wanted.refused_by_source)
        moved = change(current, wanted)
        by_url = {e.url: e for e in sup.fleet.engines}
        wanted_urls = wanted.urls()
        now = time.monotonic()
        for url in moved.removed:
            engine = by_url[url]
            if sup.sources.get(engine.name, STATIC) != STATIC and engine.name not in self.draining:
                log.info("discovery: engine %s at %s is gone from its source: draining", engine.name, url)
                self.draining[engine.name] = 0
                sup.breakers.drain(engine.name, now)
        for name in [n for n in self.draining if n in sup.fleet.by_name and sup.fleet.by_name[n].url in wanted_urls]:
            log.info("discovery: engine %s is named again: readmitted", name)
            del self.draining[name]
            sup.breakers.readmit(name, now)
        self._join([m for m in moved.added if m.source != STATIC])
        self.export()

    def _join(self, members: Iterable[Member]) -> None:
        """Join ``members``, each in a spare slot; one the table cannot take yet is deferred (said
        once) and tried again every interval, so it joins as soon as a draining engine is forgotten
        or a retired slot may be reused, with no change of its source needed."""
        sup = self.sup
        deferred: dict[str, str] = {}
        for member in members:
            spec, source = member.spec, member.source
            ident = identity(spec.name, spec.url)
            holder = sup.fleet.by_name.get(spec.name)
            with sup.shared.locked(TABLE_LOCK):  # one table writer at a time (shm.table)
                try:
                    if holder is not None:  # its old self, draining under another URL
                        raise _NotYet(f"its name is still {holder.url}'s, draining")
                    blob = descriptors.encode(spec.model_dump(), source)
                    slot = sup.shared.table.spare_slot(ident, sup.shared.oldest_worker_epoch())
                except (_NotYet, TableFull, descriptors.DescriptorTooLong, TypeError, ValueError) as exc:
                    line = f"discovery: {source}: engine {spec.name!r} at {spec.url} is refused: {exc}"
                    if self._deferred.get(spec.url) != line:
                        log.warning("%s%s", line, "; it joins when a slot frees"
                                    if isinstance(exc, (_NotYet, TableFull)) else "")
                    deferred[spec.url] = line
                    self._refused_by_source[source] = self._refused_by_source.get(source, 0) + 1
                    continue
                descriptors.write(sup.shared.region, slot, blob)
                members_now = [(e.index, _spec_of(sup, e.name)) for e in sup.fleet.engines] + [(slot, spec)]
                sup.sources[spec.name] = source
                sup.set_engines(members_now, {spec.name})
                sup.publish()  # its PROBING record before the entry turns LIVE
                sup.shared.table.make_live(slot, ident)
            log.info("discovery: %s: engine %s at %s joins (slot %d), probing", source, spec.name, spec.url, slot)
        self._deferred = deferred

    def sweep(self) -> None:
        """Every sweep: forget the draining engines no worker holds a leg on (two sweeps running);
        the gauge follows the engines' states."""
        sup = self.sup
        if not self.draining:
            self.export()
            return
        totals = sup.shared.totals(sup.shared.layout.engines)
        for name in list(self.draining):
            engine = sup.fleet.by_name.get(name)
            if engine is None:
                del self.draining[name]
                continue
            if sup.breakers.status(name).state is not State.DRAINING:  # the operator readmitted it
                del self.draining[name]
                continue
            at = engine.index
            busy = totals[2 * at] or totals[2 * at + 1]
            self.draining[name] = 0 if busy else self.draining[name] + 1
            if self.draining[name] >= 2:
                self._forget(name)
        self.export()

    def _forget(self, name: str) -> None:
        sup = self.sup
        engine = sup.fleet.by_name[name]
        with sup.shared.locked(TABLE_LOCK):
            members = [(e.index, _spec_of(sup, e.name)) for e in sup.fleet.engines if e.name != name]
            sup.set_engines(members, set())
            sup.shared.table.retire(engine.index)
        sup.shared.forget_slots()  # its slot may go to another engine: no look-up may keep it
        del self.draining[name]
        sup.sources.pop(name, None)
        self._fresh = True  # its slot and its name are free: a deferred engine may join at once
        metrics.forget_engine(name, engine.role)
        log.info("discovery: engine %s at %s drained and forgotten (slot %d retired)", name, engine.url, engine.index)

    def export(self) -> None:
        """Discovered engines per source and state (active, probing, draining, refused) as gauges."""
        counts = {(gauge_source(s), state): 0 for s in self.order for state in STATES}
        for engine in self.sup.fleet.engines:
            source = self.sup.sources.get(engine.name, STATIC)
            if source == STATIC:
                continue
            if engine.name in self.draining:
                key = "draining"
            elif self.sup.breakers.joining(engine.name):
                key = "probing"
            else:
                key = "active"
            counts[(gauge_source(source), key)] += 1
        for source, n in self._refused_by_source.items():
            counts[(gauge_source(source), "refused")] = counts.get((gauge_source(source), "refused"), 0) + n
        for (source, state), n in counts.items():
            metrics.DISCOVERY_ENGINES.labels(source, state).set(n)


def _spec_of(sup: Supervisor, name: str) -> EngineSpec:
    return sup.specs[name]
