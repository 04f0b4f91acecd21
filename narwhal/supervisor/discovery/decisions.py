"""Discovery in the supervisor (docs/behaviour.md "Engines that come and go"): read the sources,
decide, and follow them through shared memory.

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
* **The wanted fleet** is ``supervisor.discovery.wanted.wanted_fleet``: static first, then the file,
  then each DNS name in order, then Kubernetes (``kubernetes.py``: watched, so a change is read at
  the next pass); engines serving now before newcomers; a taken name or no slot left refused, the
  refusals logged once per change of what is refused.
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

``narwhal_discovery_engines{source,state}``: by source (``file``, ``dns``, ``kubernetes``) the engines found that
are ``active`` (in the fleet, not probing or draining), ``probing`` (not yet through their first
checks), ``draining`` (gone from the source, legs still finishing) and ``refused`` (a taken name,
or no engine slot left).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from narwhal import metrics
from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.breaker import State
from narwhal.supervisor.discovery.sources import DnsReader, FileReader, SourceInvalid, SourceUnreadable
from narwhal.supervisor.discovery.wanted import STATIC, Member, change, wanted_fleet
from narwhal.supervisor.membership import Decision, Drain, Forget, Join, Readmit

log = logging.getLogger("narwhal.discovery")

WARN_EVERY_S = 60.0
STATES = ("active", "probing", "draining", "refused")


class Running(Protocol):
    """What discovery reads of the running fleet (the supervisor's), never changing it."""

    @property
    def fleet(self) -> Fleet:
        """The engines now, each at its engine slot."""
        ...

    @property
    def sources(self) -> Mapping[str, str]:
        """Engine name -> the source it came from (``static``, ``file``, ``dns:NAME``)."""
        ...

    @property
    def specs(self) -> Mapping[str, EngineSpec]:
        """Engine name -> its ``[[engines]]`` entry."""
        ...

    @property
    def slots(self) -> int:
        """How many engines the shared table holds at most."""
        ...

    def state(self, name: str) -> State:
        """``name``'s breaker state now."""
        ...

    def joining(self, name: str) -> bool:
        """Is ``name`` still in its first checks (PROBING since it joined)?"""
        ...


def gauge_source(source: str) -> str:
    """The ``source`` label of the discovery gauge: every DNS name counts as ``dns``."""
    return "dns" if source.startswith("dns:") else source


class Discovery:
    """docs/behaviour.md "Engines that come and go" in the supervisor: sources read off the loop, their last good sets
    compared with the running fleet into decisions the loop applies.
    """

    def __init__(self, running: Running, settings: Settings) -> None:
        self.settings = settings.discovery
        self.static = list(settings.engines)
        self.order = ((["file"] if self.settings.file else []) + [f"dns:{d.name}" for d in self.settings.dns]
                      + (["kubernetes"] if self.settings.kubernetes else []))
        bound_s = min(self.settings.interval_s, 5.0)
        self._dns = DnsReader(self.settings, bound_s) if self.settings.dns else None
        self._file = FileReader(self.settings.file, bound_s) if self.settings.file else None
        # Watched, not polled: each change makes the next pass read the sources (kubernetes.py).
        self._k8s = None
        if self.settings.kubernetes:  # imported only then: kubernetes_asyncio costs the other sources nothing
            from narwhal.supervisor.discovery.kubernetes import KubernetesWatch

            self._k8s = KubernetesWatch(self.settings.kubernetes, self._changed)
        by_source: dict[str, list[EngineSpec]] = {source: [] for source in self.order}
        for engine in running.fleet.engines:  # what the table holds from each source: its last good set
            source = running.sources.get(engine.name, STATIC)
            if source in by_source:
                by_source[source].append(running.specs[engine.name])
        self.last_good = by_source
        self._warned: dict[str, tuple[float, str]] = {}
        self._task: asyncio.Task[None] | None = None
        self._next_read = 0.0
        self._fresh = True  # decide once at start: the table's set against the static entries
        self._refused: list[str] = []
        self._refused_by_source: dict[str, int] = {}
        # URL -> the line said: engines the table could not take yet (no spare slot, or their name
        # still held by a draining engine); decided again every interval until they join.
        self._deferred: dict[str, str] = {}
        self._said: dict[str, str] = {}  # the deferred lines said before this decision: said once
        self.draining: dict[str, int] = {}  # engine -> sweeps seen with no leg on it

    # -- reading -------------------------------------------------------------------------------

    def _changed(self) -> None:
        """A watched source moved: read the sources at the next pass, not at the next interval."""
        self._next_read = 0.0

    def close(self) -> None:
        """Stop the watches (the supervisor stops)."""
        if self._k8s is not None:
            self._k8s.close()

    def tick(self, now: float, running: Running) -> list[Decision]:
        """From the loop: start the next read when due (never two at once); decide on what came."""
        if self._k8s is not None:
            self._k8s.start()  # once: its tasks run on the supervisor's loop
        if self._task is None and now >= self._next_read:
            self._next_read = now + self.settings.interval_s
            self._task = asyncio.ensure_future(self._read_all())
            self._task.add_done_callback(self._read_done)
            if self._deferred or self._refused:
                self._fresh = True  # a slot or a name may have freed meanwhile
        if not self._fresh:
            return []
        self._fresh = False
        try:
            return self.decide(running)
        except Exception:  # a defect here must not stop the supervisor (it would restart, and read the same)
            log.exception("discovery: deciding on the sources failed; the fleet stays as it was")
            return []

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
                elif source == "kubernetes":
                    assert self._k8s is not None
                    listed = self._k8s.engines()
                    if listed is None:
                        continue  # not listed yet: nothing to say (its first list makes the next pass read)
                    found = listed
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

    # -- deciding ------------------------------------------------------------------------------

    def decide(self, running: Running) -> list[Decision]:
        """The wanted fleet against the running one: the gone drained, those named again
        readmitted, the new joined (a name still held by a draining engine deferred)."""
        fleet = running.fleet
        current = {e.url for e in fleet.engines}
        wanted = wanted_fleet(self.static, {s: self.last_good.get(s, []) for s in self.order}, current,
                              running.slots)
        if wanted.refused != self._refused:
            for line in wanted.refused:
                log.warning("%s", line)
        self._refused, self._refused_by_source = wanted.refused, dict(wanted.refused_by_source)
        moved = change(current, wanted)
        by_url = {e.url: e for e in fleet.engines}
        wanted_urls = wanted.urls()
        decisions: list[Decision] = []
        for url in moved.removed:
            engine = by_url[url]
            if running.sources.get(engine.name, STATIC) != STATIC and engine.name not in self.draining:
                log.info("discovery: engine %s at %s is gone from its source: draining", engine.name, url)
                self.draining[engine.name] = 0
                decisions.append(Drain(engine.name))
        for name in [n for n in self.draining if n in fleet.by_name and fleet.by_name[n].url in wanted_urls]:
            log.info("discovery: engine %s is named again: readmitted", name)
            del self.draining[name]
            decisions.append(Readmit(name))
        self._said, self._deferred = self._deferred, {}
        for member in moved.added:
            if member.source == STATIC:
                continue
            holder = fleet.by_name.get(member.spec.name)
            if holder is not None:  # its old self, draining under another URL
                self.refused(member, f"its name is still {holder.url}'s, draining", passing=True)
            else:
                decisions.append(Join(member.spec, member.source))
        return decisions

    def refused(self, member: Member | Join, why: str, passing: bool) -> None:
        """A join the table could not take (``passing``: for a reason that passes, a slot or a name
        held): said once, and tried again every interval, so it joins as soon as a draining engine
        is forgotten or a retired slot may be reused, with no change of its source needed."""
        spec, source = member.spec, member.source
        line = f"discovery: {source}: engine {spec.name!r} at {spec.url} is refused: {why}"
        if self._said.get(spec.url) != line and self._deferred.get(spec.url) != line:
            log.warning("%s%s", line, "; it joins when a slot frees" if passing else "")
        self._deferred[spec.url] = line
        self._refused_by_source[source] = self._refused_by_source.get(source, 0) + 1

    def sweep(self, running: Running, totals: Sequence[int]) -> list[Decision]:
        """Every sweep: forget the draining engines no worker holds a leg on (two sweeps running;
        ``totals``: the in-flight legs, two per engine slot); the gauge follows the engines' states."""
        forget: list[Decision] = []
        for name in list(self.draining):
            engine = running.fleet.by_name.get(name)
            if engine is None or running.state(name) is not State.DRAINING:  # gone, or the operator readmitted it
                del self.draining[name]
                continue
            at = engine.index
            busy = totals[2 * at] or totals[2 * at + 1]
            self.draining[name] = 0 if busy else self.draining[name] + 1
            if self.draining[name] >= 2:
                del self.draining[name]
                self._fresh = True  # its slot and its name free: a deferred engine may join at once
                forget.append(Forget(name))
        return forget

    def export(self, running: Running) -> None:
        """Discovered engines per source and state (active, probing, draining, refused) as gauges."""
        counts = {(gauge_source(s), state): 0 for s in self.order for state in STATES}
        for engine in running.fleet.engines:
            source = running.sources.get(engine.name, STATIC)
            if source == STATIC:
                continue
            if engine.name in self.draining:
                key = "draining"
            elif running.joining(engine.name):
                key = "probing"
            else:
                key = "active"
            counts[(gauge_source(source), key)] += 1
        for source, n in self._refused_by_source.items():
            counts[(gauge_source(source), "refused")] = counts.get((gauge_source(source), "refused"), 0) + n
        for (source, state), n in counts.items():
            metrics.DISCOVERY_ENGINES.labels(source, state).set(n)
