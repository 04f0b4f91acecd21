"""The engine table (narwhal.shm.table): engine slots follow identities across reloads."""

from __future__ import annotations

import os

import pytest

from narwhal.errors import EngineError
from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import FREE, LIVE, RETIRED, TableFull, identity, worker_epoch
from narwhal.shm.worker import UnmappedEngine, WorkerFleetState
from narwhal.supervisor.edge import Supervisor


def _engines(*names: str) -> list[tuple[str, str]]:
    return [(n, f"http://{n}:8000") for n in names]


def test_kept_engines_keep_their_slots_and_removed_ones_retire(shared: SharedFleet) -> None:
    assert shared.assign_engines(_engines("a", "b", "c")) == [0, 1, 2]
    assert shared.table.epoch == 0
    assert shared.assign_engines(_engines("a", "c", "d")) == [0, 2, 3]  # d: a free slot, never b's
    assert shared.table.entry(1).state == RETIRED and shared.table.epoch == 1
    assert shared.assign_engines(_engines("b", "a")) == [1, 0]  # b back on its own slot
    assert [shared.table.entry(s).state for s in range(4)] == [LIVE, LIVE, RETIRED, RETIRED]


def test_a_retired_slot_goes_to_another_engine_only_once_no_worker_can_refer_to_it(shared: SharedFleet) -> None:
    shared.assign_engines(_engines("a", "b", "c", "d"))
    old = shared.claim_slot(os.getpid())  # a worker of the first list, still running
    assert old is not None
    shared.region.set_u32(shared.layout.slot_offset(old) + 36, worker_epoch(shared.table, [0, 1, 2, 3]))
    shared.assign_engines(_engines("a", "b", "c"))  # d retired at epoch 1
    with pytest.raises(TableFull):
        shared.assign_engines(_engines("a", "b", "c", "e"))  # d's slot may still be used by the old worker
    assert shared.release(old, os.getpid())  # the old worker is gone
    assert shared.assign_engines(_engines("a", "b", "c", "e")) == [0, 1, 2, 3]
    assert shared.table.entry(3).identity == identity("e", "http://e:8000")


def test_the_same_name_at_another_url_is_another_engine(shared: SharedFleet) -> None:
    assert shared.assign_engines([("a", "http://x:1")]) == [0]
    assert shared.assign_engines([("a", "http://y:1")]) == [1]
    assert shared.table.entry(0).state == RETIRED and shared.table.entry(2).state == FREE


def _settings(*names: str) -> Settings:
    return Settings(engines=[{"name": n, "url": f"http://{n}:8000", "role": "both"} for n in names])


def test_an_old_workers_report_lands_on_the_engine_it_used_after_a_reload(shared: SharedFleet) -> None:
    shared.assign_engines(_engines("a", "b", "c"))
    old_fleet = Fleet(_settings("a", "b", "c"))
    slot = shared.claim_slot(os.getpid())
    assert slot is not None
    old = WorkerFleetState(shared, slot, old_fleet)
    shared.assign_engines(_engines("a", "c"))  # SIGHUP: b removed, c is now second in the list
    new = Supervisor(shared, _settings("a", "c"))
    c = old_fleet.by_name["c"]
    error = EngineError("boom", reason="engine_5xx", engine="c", phase="prefill")
    for _ in range(2):
        old.report(c, c, error=error, failed=c)  # an old worker's streams through c fail
    b = old_fleet.by_name["b"]
    old.report(b, b, error=error, failed=b)  # and one through b, which is gone
    new.drain()
    # Keyed by list position, c's reports went nowhere (position 2 is gone) and b's went to c.
    assert new.breakers.status("c").failure_streak == 2
    assert new.breakers.status("a").failure_streak == 0


def test_a_worker_whose_engine_has_no_slot_is_told(shared: SharedFleet) -> None:
    shared.assign_engines(_engines("a"))
    with pytest.raises(UnmappedEngine, match="b"):
        WorkerFleetState(shared, 0, Fleet(_settings("a", "b")))


def test_counts_of_an_engine_are_shared_by_old_and_new_workers_at_its_slot(shared: SharedFleet) -> None:
    shared.assign_engines(_engines("a", "b", "c"))
    old_fleet = Fleet(_settings("a", "b", "c"))
    slots = [shared.claim_slot(os.getpid()), shared.claim_slot(1)]  # an old worker and a new one
    assert slots == [0, 1]
    old = WorkerFleetState(shared, 0, old_fleet)
    assert old.try_reserve(old_fleet.by_name["c"], "decode", cap=1)  # an old stream holds c's one slot
    shared.assign_engines(_engines("a", "c"))
    new_fleet = Fleet(_settings("a", "c"))
    new = WorkerFleetState(shared, 1, new_fleet)
    c = new_fleet.by_name["c"]
    assert new.both_totals() == ([0, 0], [0, 1]) and new.totals("decode") == [0, 1]
    assert new.count(c, "decode") == 1 and not new.try_reserve(c, "decode", cap=1)
