"""A worker following a fleet that changes at run time (discovery, docs/behaviour.md "Engines that come and go"),
through shared memory.

With a ``[discovery]`` source, a worker's engines are not its settings' ``[[engines]]`` but the
LIVE entries of the engine table and their descriptors (``shm.table``, ``shm.descriptors``):
static engines written there by the master, discovered ones by the supervisor. Each engine's
``Engine.index`` is its engine slot, so every list by index (counts, records, loads, placement's
hashes) stays right whatever comes and goes, and the worker's in-flight counts, written at the
slot, need no moving.

Invariants:

* No IPC and nothing extra per request: :meth:`RosterFollower.check` runs every
  :data:`FOLLOW_S` on the worker's loop and compares one u32, the table epoch, with the one it
  last took up; only when it moved does it read the table and the descriptors again and rebuild
  the roster (``Fleet.replace``: unchanged engines keep their ``Engine`` objects, and the
  placement caches follow ``fleet.version``).
* A new engine is not placed before its first record is read (``WorkerFleetState.follow``):
  the supervisor writes it PROBING before the table entry turns LIVE, but that store may be seen
  later on aarch64.
* The epoch noted in the worker's slot moves only once the worker holds nothing — no leg in
  flight, no decode unsent — on any engine slot retired up to it: until then it notes one less
  than that slot's retirement, so the slot is not given to another engine under this worker's
  legs (``shm.table``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from narwhal import shm
from narwhal.fleet import Engine, Fleet
from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec
from narwhal.shm.local import LocalFleetState
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import RETIRED
from narwhal.shm.worker import WorkerFleetState
from narwhal.worker import following

log = logging.getLogger("narwhal.worker.roster")



def members(shared: SharedFleet) -> tuple[list[tuple[int, EngineSpec]], bool, set[str]]:
    """The engines of the table now (by engine slot), whether every LIVE slot was readable, and
    the names of the discovered ones (not ``static``)."""
    out = []
    discovered = set()
    for slot, entry, source in shared.described():
        try:
            out.append((slot, EngineSpec(**entry)))
        except ValueError:  # written by a writer of another version: taken up when it is rewritten
            continue
        if source != "static":
            discovered.add(entry["name"])
    return out, len(out) == shared.live_slots(), discovered


def fleet_from_table(settings: Settings, shared: SharedFleet) -> tuple[Fleet, int]:
    """The worker's fleet from the engine table's LIVE entries, and the epoch read before them."""
    epoch = shared.table.epoch  # read first: what is noted may be older than what was read, never newer
    found, _, _ = members(shared)
    return Fleet(settings, found), epoch


def fleet_and_state(
    settings: Settings, make_state: Callable[[Fleet, bool], WorkerFleetState | LocalFleetState]
) -> tuple[Fleet, WorkerFleetState | LocalFleetState, RosterFollower | None]:
    """The worker's fleet and state: its settings' engines without ``[discovery]``; with it, the
    table's by engine slot and the follower that keeps them current (without a worker slot in
    shared memory, the static engines on per-process state: no supervisor reaches it)."""
    shared = shm.SHARED
    if not settings.discovery.enabled or shared is None:
        fleet = Fleet(settings)
        return fleet, make_state(fleet, False), None
    fleet, epoch = fleet_from_table(settings, shared)
    state = make_state(fleet, True)
    if not isinstance(state, WorkerFleetState):
        fleet = Fleet(settings)
        return fleet, LocalFleetState(fleet), None
    return fleet, state, RosterFollower(shared, fleet, state, epoch)


def scraped(settings: Settings, fleet: Fleet) -> frozenset[str] | None:
    """The engines whose series a scrape shows (None: all): with discovery, the fleet's only, so a
    forgotten engine's series go with it (a multiprocess sample cannot be deleted: ``metrics``)."""
    return frozenset(e.name for e in fleet.engines) if settings.discovery.enabled else None


class RosterView(Protocol):
    """A placement policy's view of its shared memory (``PolicyRegion.worker``), as the roster moves it."""

    def roster(self, engines: Sequence[Engine]) -> None:
        """The worker's engines are now ``engines``."""


class RosterFollower:
    """Keeps a worker's fleet the engine table's (with ``[discovery]``); one u32 compare per check."""

    def __init__(self, shared: SharedFleet, fleet: Fleet, state: WorkerFleetState, epoch: int) -> None:
        self.shared = shared
        self.fleet = fleet
        self.state = state
        self._seen = epoch
        self._leaving: set[int] = set()  # engine slots removed from the roster with legs still on them
        # The placement policy's view of its shared memory, when it has one (compose): it follows the roster too.
        self.policy_view: RosterView | None = None
        _, _, discovered = members(shared)
        # A discovered engine waits for its first record even at this worker's start.
        state.follow([e for e in fleet.engines if e.name in discovered], [])
        self.check()

    def check(self) -> None:
        """Take up a moved epoch; note it only once nothing is held on a slot retired by then."""
        epoch = self.shared.table.epoch
        if epoch != self._seen:
            found, complete, _ = members(self.shared)
            added, removed = self.fleet.replace(found)
            self.state.follow(added, removed)
            if self.policy_view is not None and (added or removed):
                self.policy_view.roster(self.fleet.engines)
            self._leaving.update(e.index for e in removed)
            for e in added:
                log.info("engine %s at %s joins this worker's fleet (probing until the supervisor admits it)",
                         e.name, e.url)
            for e in removed:
                log.info("engine %s at %s leaves this worker's fleet", e.name, e.url)
            if complete:
                self._seen = epoch
        self._leaving = {s for s in self._leaving if self.state.holds(s)}
        note = self._seen
        for s in self._leaving:
            entry = self.shared.table.entry(s)
            if entry.state == RETIRED:
                note = min(note, entry.epoch - 1)
        self.state.note_epoch(max(note, 0))

    async def keep_following(self) -> None:
        """:meth:`check` every ``FOLLOW_S`` until cancelled (:mod:`narwhal.worker.following`)."""
        await following.keep_following(self.check, "the engine table")
