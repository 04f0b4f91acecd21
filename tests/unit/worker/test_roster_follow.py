"""A worker following the engine table at run time (docs/behaviour.md "Engines that come and go"): its roster, its
noted epoch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from narwhal.settings import Settings
from narwhal.shm import descriptors
from narwhal.shm import layout as L
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import TableFull, identity
from narwhal.shm.worker import WorkerFleetState
from narwhal.worker.roster_follow import RosterFollower, fleet_from_table


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    fleet = SharedFleet.create(engines=2, slots=4, ring=8)
    yield fleet
    fleet.close()


def _join(shared: SharedFleet, name: str) -> int:
    url = f"http://{name}:1"
    slot = shared.table.spare_slot(identity(name, url), shared.oldest_worker_epoch())
    descriptors.write(shared.region, slot, descriptors.encode({"name": name, "url": url, "role": "both"}, "file"))
    shared.table.make_live(slot, identity(name, url))
    return slot


def _noted(shared: SharedFleet, slot: int) -> int:
    return shared.region.u32(shared.layout.slot_offset(slot) + L.SLOT_TABLE_EPOCH)


def test_a_retired_slot_is_let_go_only_once_the_workers_legs_on_it_are_done(shared: SharedFleet) -> None:
    _join(shared, "a")
    _join(shared, "b")
    fleet, epoch = fleet_from_table(Settings(discovery={"file": "engines.toml"}), shared)
    slot = shared.claim_slot(os.getpid())
    assert slot is not None
    state = WorkerFleetState(shared, slot, fleet, by_slot=True)
    follower = RosterFollower(shared, fleet, state, epoch)
    a = fleet.by_name["a"]
    assert [(e.name, e.index) for e in fleet.engines] == [("a", 0), ("b", 1)]
    assert not state.admitted(a) and not state.placeable(a)  # no record from the supervisor yet
    assert state.try_reserve(a, "decode", None)
    shared.table.retire(a.index)
    retired_at = shared.table.epoch
    follower.check()
    assert list(fleet.by_name) == ["b"]  # no new leg on it
    assert _noted(shared, slot) == retired_at - 1  # but its slot is still this worker's
    with pytest.raises(TableFull):
        shared.table.spare_slot(identity("c", "http://c:1"), shared.oldest_worker_epoch())
    state.release(a, "decode")  # the leg that was in flight ends
    follower.check()
    assert _noted(shared, slot) == retired_at
    assert _join(shared, "c") == 0
    follower.check()
    assert [(e.name, e.index) for e in fleet.engines] == [("c", 0), ("b", 1)]
