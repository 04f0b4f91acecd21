"""Policy ``held``'s supervisor part: the holdings model kept, fed and published (docs/behaviour.md "Placement").

The supervisor knows no policy: it builds whatever part the configured policy names
(``supervisor.policy_part``) over the region the master created for it, and calls it from its
loop. This part owns everything ``held`` keeps in the supervisor: the holdings model
(``supervisor.holdings.model``), the workers' prefill rings it merges, the predictions counter,
and the sections of the holdings region (``shm.holdings``) it alone writes.

Invariants, and why:

* One writer: only this part writes the region's sections and advances its rings' read indexes.
* A section per engine slot, stamped with the engine's identity: a producer's learned keys, a
  consumer's events' keys alone, so a worker never reads one engine's blocks as another's.
* Each prefill with reported cached tokens is judged once, in order of completion across workers:
  judged in ring order, a prefill that hit what another worker's finished a moment earlier would
  read as ``under`` and that one's as ``over``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from narwhal import metrics
from narwhal.fleet import Engine
from narwhal.fleet.blame import State
from narwhal.settings import Settings
from narwhal.shm.holdings import Holdings, section_stamp
from narwhal.supervisor.holdings.model import EventBlocks, HoldingsModel
from narwhal.supervisor.reports import RingIndexes

# Engines placement does not send new prefixes to: no homes there.
_NO_HOMES = frozenset({State.EJECTED, State.PROBING, State.DRAINING})


class HoldingsPart:
    """The holdings model over its region (the module's text): ``supervisor.policy_part.PolicyPart``."""

    def __init__(self, region: Holdings, settings: Settings, engines: Sequence[Engine],
                 followed: Callable[[], Mapping[int, EventBlocks]]) -> None:
        self.region = region
        self.model = HoldingsModel(self._stamps(engines), region.layout.keys,
                                   settings.placement.held.block_chars, engines)
        self.model.events = followed
        self.model.consumer_stamps = self._consumer_stamps(engines)
        layout = region.layout
        self._rings = RingIndexes(layout.ring_offset(0), layout.ring_offset(1) - layout.ring_offset(0))
        # The series exist (at 0) from the start, so a rate() sees the first one.
        self._predictions = {r: metrics.HOLDINGS_PREDICTIONS.labels(r) for r in ("exact", "over", "under")}
        self.on_reading = self.model.engine_read  # each load read's capacity and prefill counters

    def _stamps(self, engines: Sequence[Engine]) -> list[int | None]:
        """Per section (an engine slot), the stamp of the producer there; None: no producer."""
        stamps: list[int | None] = [None] * self.region.layout.sections
        for e in engines:
            if e.can_prefill and e.index < len(stamps):
                stamps[e.index] = section_stamp(e.name, e.url)
        return stamps

    def _consumer_stamps(self, engines: Sequence[Engine]) -> dict[int, int]:
        """Per consumer's section (an engine slot), its stamp: what its KV-cache events are published under."""
        sections = self.region.layout.sections
        return {e.index: section_stamp(e.name, e.url) for e in engines if not e.can_prefill and e.index < sections}

    def restore(self) -> None:
        """A (re)started supervisor takes over what the last one published: a restart loses no holdings."""
        self.model.restore(self.region)

    def reshape(self, engines: Sequence[Engine]) -> None:
        """The fleet changed (discovery): a producer that joined gets its section, one that left loses it."""
        self.model.reshape(self._stamps(engines), engines)
        old, new = self.model.consumer_stamps, self._consumer_stamps(engines)
        for index, stamp in old.items():
            if new.get(index) != stamp:  # gone, or another engine at its slot: what it held is not known
                self.model.consumer_keys.pop(index, None)
        self.model.consumer_stamps = new

    def states(self, engines: Sequence[Engine], state_of: Callable[[Engine], State]) -> None:
        """The breakers' states as just published: an ejected producer's cache is not to be counted
        on, and no new prefix is given a home where placement would not send it."""
        out = set()
        for engine in engines:
            state = state_of(engine)
            if state == State.EJECTED:
                self.model.forget(engine.index)
            if state in _NO_HOMES:
                out.add(engine.index)
        self.model.out = frozenset(out)

    def forget(self, engine: Engine) -> None:
        """The engine's cache is not what was known (its KV-cache events say so, or it came back
        after refusing connections): its learned keys go."""
        self.model.forget(engine.index)

    def drain(self, slots_in_use: int, now: float) -> None:
        """The workers' completed prefills into the model, in order of completion, then what changed published."""
        region = self.region
        claimed = min(region.layout.slots, slots_in_use)  # slots ever claimed
        reports = [rep for slot in self._rings.written(region.mm, claimed) for rep in region.drain(slot)]
        reports.sort(key=lambda rep: rep.at)
        judged = [result for result in map(self.model.apply, reports) if result is not None]
        for result, counter in self._predictions.items():  # one inc per result a drain, not per prefill
            count = judged.count(result)
            if count:
                counter.inc(count)
        self.model.publish(region, now)

    def worker_gone(self, slot: int) -> None:
        """A worker died without a word: its ring's unread reports are skipped."""
        self.region.skip(slot)
