"""Engine load in shared memory (docs/behaviour.md "Placement"): the supervisor's records, the workers' lock-free
view.
"""

from __future__ import annotations

from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.shm.records import EngineRecord, LoadRecord, read_load, read_record, write_load, write_record
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.shm.worker import WorkerFleetState

P0, D0 = record_hash("p0", "http://127.0.0.1:1"), record_hash("d0", "http://127.0.0.1:2")


def test_load_round_trip_absence_and_no_kv(shared: SharedFleet) -> None:
    assert read_load(shared.region, 0) is None
    write_load(shared.region, 1, LoadRecord(12.5, 3.0, 2.0, 0.5, D0, ours=2.0), version=1)
    write_load(shared.region, 2, LoadRecord(13.0, 1.0, 0.0, None, 9), version=2)
    assert read_load(shared.region, 1) == LoadRecord(12.5, 3.0, 2.0, 0.5, D0, ours=2.0)
    assert read_load(shared.region, 2) == LoadRecord(13.0, 1.0, 0.0, None, 9)
    assert read_load(shared.region, 3) is None


def test_load_records_do_not_overlap_breaker_records_or_slots(shared: SharedFleet) -> None:
    rec = EngineRecord(version=5, state=2, failure_streak=1, ejections=1, quarantined_until=None,
                       last_failure_reason=None, last_failure_at=None, name_hash=9)
    for i in range(4):
        write_record(shared.region, i, rec)
        write_load(shared.region, i, LoadRecord(1.0, 1.0, 1.0, 1.0, 9), version=1)
    slot = shared.claim_slot(12345)
    assert slot is not None and shared.slot_counts(slot) == (0,) * 8
    assert all(read_record(shared.region, i) == rec for i in range(4))


def test_the_worker_sees_readings_of_its_own_engines_only(shared: SharedFleet) -> None:
    settings = Settings(engines=[{"name": "p0", "role": "producer", "url": "http://127.0.0.1:1"},
                                 {"name": "d0", "role": "consumer", "url": "http://127.0.0.1:2"}])
    shared.assign_engines([("p0", "http://127.0.0.1:1"), ("d0", "http://127.0.0.1:2")])
    slot = shared.claim_slot(1)
    assert slot is not None
    state = WorkerFleetState(shared, slot, Fleet(settings))
    assert state.load_readings() == [None, None]
    before = state.load_version()
    write_load(shared.region, 0, LoadRecord(1.0, 2.0, 3.0, 0.25, P0), version=1)
    write_load(shared.region, 1, LoadRecord(1.0, 2.0, 3.0, 0.25, record_hash("p0", "http://127.0.0.1:9")), version=1)
    shared.bump_load_generation()
    assert state.load_version() == before + 1
    assert state.load_readings() == [LoadRecord(1.0, 2.0, 3.0, 0.25, P0), None]


def test_the_worker_keeps_reading_until_the_records_carry_the_generation_it_saw(shared: SharedFleet) -> None:
    settings = Settings(engines=[{"name": "p0", "role": "producer", "url": "http://127.0.0.1:1"}])
    shared.assign_engines([("p0", "http://127.0.0.1:1")])
    state = WorkerFleetState(shared, 0, Fleet(settings))
    rec = EngineRecord(version=1, state=2, failure_streak=1, ejections=1, quarantined_until=None,
                       last_failure_reason=None, last_failure_at=None, name_hash=P0)
    shared.bump_generation()  # generation 1 seen before its record (stores out of order on aarch64)
    assert state.records() == [None]
    write_record(shared.region, 0, rec)
    assert state.records() == [rec]  # read again: the generation was not taken as read
    start = shared.layout.record_offset(0)
    shared.region.set_u64(start, shared.region.u64(start) + 1)  # generation 2: mid-write
    shared.bump_generation()
    assert state.records() == [rec]  # busy: what it had, not "no record" (that would admit it)
