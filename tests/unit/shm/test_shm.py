"""The shared fleet layout: checksummed records, outcome rings, slots, exact caps across processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from narwhal.shm import layout as L
from narwhal.shm.records import KIND_OUTCOME, EngineRecord, RecordBusy, Report, read_record, write_record
from narwhal.shm.shared import SharedFleet


def _record(n: int) -> EngineRecord:
    # Every field derives from n: a torn read mixes two n's and is caught by the test.
    return EngineRecord(
        version=n, state=n % 6, failure_streak=n, ejections=n * 3, quarantined_until=float(n),
        last_failure_reason="engine_5xx" if n % 2 else "decode_silence", last_failure_at=float(n) + 0.5,
        name_hash=n & 0xFFFFFFFF,
    )


def _consistent(rec: EngineRecord) -> bool:
    n = rec.version
    return rec == _record(n)


def test_record_round_trip_and_absence(shared: SharedFleet) -> None:
    assert read_record(shared.region, 0) is None
    write_record(shared.region, 1, _record(7))
    assert read_record(shared.region, 1) == _record(7)
    assert read_record(shared.region, 2) is None


def test_no_torn_record_is_ever_read_while_a_writer_hammers_it(shared: SharedFleet) -> None:
    # Bounded by counts, not by a time slice: on a loaded host the reader gets fewer turns, and
    # the race must still be run long enough to mean something (up to 20 s).
    pid = os.fork()
    if pid == 0:  # the writer: rewrite the record as fast as it can until the reader is done
        try:
            n, end = 1, time.monotonic() + 25
            while time.monotonic() < end and os.getppid() != 1:
                write_record(shared.region, 0, _record(n))
                n += 1
        finally:
            os._exit(0)
    reads = distinct = 0
    last = -1
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end and (reads <= 10_000 or distinct <= 100):
            try:
                rec = read_record(shared.region, 0)
            except RecordBusy:
                continue  # mid-write every time it looked: the caller keeps what it had
            if rec is None:
                continue
            assert _consistent(rec), rec
            reads += 1
            if rec.version != last:
                distinct += 1
                last = rec.version
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert reads > 10_000
    assert distinct > 100  # the reader really raced the writer


def _report(at: float, producer: int = 0) -> Report:
    return Report(seq=0, at=at, producer=producer, consumer=1, failed=1, reason=2, flags=3, kind=KIND_OUTCOME)


def test_ring_delivers_in_order_and_drops_when_full(shared: SharedFleet) -> None:
    slot = shared.claim_slot(os.getpid())
    assert slot is not None
    for i in range(8):
        assert shared.append(slot, _report(float(i)))
    assert not shared.append(slot, _report(99.0))  # full: the supervisor has not read yet
    got = shared.drain(slot)
    assert [r.at for r in got] == [float(i) for i in range(8)]
    assert [r.seq for r in got] == list(range(8))
    assert (got[0].producer, got[0].consumer, got[0].failed, got[0].reason, got[0].flags) == (0, 1, 1, 2, 3)
    assert shared.append(slot, _report(8.0))
    assert [r.at for r in shared.drain(slot)] == [8.0]
    assert shared.drain(slot) == []


def test_a_half_written_report_waits_for_the_next_drain(shared: SharedFleet) -> None:
    slot = shared.claim_slot(os.getpid())
    assert slot is not None
    shared.append(slot, _report(1.0))
    off = shared.layout.ring_offset(slot, 0)
    good = bytes(shared.mm[off : off + 32])
    shared.mm[off + 8 : off + 16] = b"\xff" * 8  # as if the payload were not visible yet
    assert shared.drain(slot) == []
    shared.mm[off : off + 32] = good
    assert [r.at for r in shared.drain(slot)] == [1.0]


def test_slots_are_claimed_once_and_reclaimed_from_dead_workers(shared: SharedFleet) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a worker that is gone
    mine = shared.claim_slot(os.getpid())
    assert mine is not None
    dead_slot = shared.claim_slot(pid)  # claimed while it lived
    assert dead_slot == mine + 1
    shared.set_count(dead_slot, 2, 1, 5)
    assert shared.totals()[2 * 2 + 1] == 5
    others = [shared.claim_slot(os.getpid() + 100000 + i) for i in range(3)]
    assert dead_slot in others  # the dead worker's slot was free to take …
    assert shared.totals()[2 * 2 + 1] == 0  # … and its counts were released


def test_fleet_totals_sum_every_claimed_slot(shared: SharedFleet) -> None:
    a = shared.claim_slot(os.getpid())
    b = shared.claim_slot(1)  # pid 1 (init) is alive: a second, live owner
    assert a is not None and b is not None and a != b
    shared.set_count(a, 0, 0, 2)
    shared.set_count(b, 0, 0, 3)
    shared.set_count(b, 3, 1, 1)
    totals = shared.totals()
    assert totals[0] == 5 and totals[3 * 2 + 1] == 1 and shared.engine_total(0, 0) == 5


def test_a_cap_of_one_is_exact_across_processes(shared: SharedFleet) -> None:
    """Two processes race to reserve a capped slot thousands of times: never two holders."""
    violations = SharedFleet.create(engines=1, slots=1, ring=1)  # a scratch flag at an unused header offset

    def worker() -> None:
        slot = shared.claim_slot(os.getpid())
        assert slot is not None
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            with shared.locked(SharedFleet.cap_lock(0, 1)):
                if shared.engine_total(0, 1) >= 1:
                    continue
                shared.set_count(slot, 0, 1, 1)
            if shared.engine_total(0, 1) > 1:
                violations.region.set_u32(56, 1)
            shared.set_count(slot, 0, 1, 0)

    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                worker()
            finally:
                os._exit(0)
        pids.append(pid)
    try:
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert violations.region.u32(56) == 0
    violations.close()


def test_the_unsent_decodes_sit_between_the_counts_and_the_ring_and_go_with_the_slot() -> None:
    shared = SharedFleet.create(engines=3, slots=2, ring=4)  # an odd engine count
    try:
        layout = shared.layout
        assert layout.slot_size % 8 == 0  # every slot's u64 fields stay aligned
        counts_end = layout.counts_offset(1) + 3 * 8
        assert layout.unsent_offset(1, 0) == counts_end and layout.unsent_offset(1, 2) + 4 <= layout.ring_offset(1, 0)
        slot = shared.claim_slot(os.getpid())
        assert slot is not None
        shared.set_count(slot, 2, 1, 5)  # five decode slots on engine 2, three not sent yet
        shared.region.set_u32(layout.unsent_offset(slot, 2), 3)
        assert shared.engine_seen(2) == 2
        assert shared.append(slot, _report(1.0)) and [r.at for r in shared.drain(slot)] == [1.0]
        shared.clear_slot(slot)
        assert shared.region.u32(layout.unsent_offset(slot, 2)) == 0 and shared.engine_seen(2) == 0
    finally:
        shared.close()


def test_a_reader_never_sees_a_heartbeat_or_pid_half_written(shared: SharedFleet) -> None:
    # struct.pack_into zeroes a field before writing it: a keeper that read the heartbeat then
    # took a healthy supervisor for one that never beat, and killed it.
    pid = os.fork()
    if pid == 0:
        try:
            end = time.monotonic() + 3
            while time.monotonic() < end:
                shared.beat(os.getpid())
                time.sleep(0.0005)
        finally:
            os._exit(0)
    try:
        end = time.monotonic() + 5
        while shared.supervisor_pid != pid and time.monotonic() < end:
            time.sleep(0.001)
        reads = bad = 0
        end = time.monotonic() + 2
        while time.monotonic() < end:
            reads += 1
            if shared.heartbeat_age_s > 1.0 or shared.supervisor_pid != pid:
                bad += 1
    finally:
        os.waitpid(pid, 0)
    assert reads > 100_000
    assert bad == 0, f"{bad} of {reads} reads saw a heartbeat over a second old"


def test_a_record_left_mid_write_is_busy_for_readers_and_whole_for_a_restarting_supervisor(
    shared: SharedFleet,
) -> None:
    write_record(shared.region, 0, _record(7))
    start = shared.layout.record_offset(0)
    seq = shared.region.u64(start)
    assert seq == 2  # even: written once, whole
    shared.region.set_u64(start, seq + 1)  # a writer killed after its first store
    with pytest.raises(RecordBusy):
        read_record(shared.region, 0)
    assert read_record(shared.region, 0, writer_gone=True) == _record(7)
    write_record(shared.region, 0, _record(8))  # the next writer steps over the odd generation
    assert shared.region.u64(start) == seq + 3 + 1 and read_record(shared.region, 0) == _record(8)


def test_a_body_under_a_generation_it_was_not_written_for_is_not_read(shared: SharedFleet) -> None:
    write_record(shared.region, 0, _record(7))
    start = shared.layout.record_offset(0)
    shared.region.set_u64(start, 4)  # the new generation seen before the new body (reordered stores)
    with pytest.raises(RecordBusy):
        read_record(shared.region, 0)


def test_scans_stop_at_the_highest_slot_ever_claimed() -> None:
    fleet = SharedFleet.create(engines=2, slots=512, ring=8)
    try:
        assert fleet.in_use() == 0 and fleet.totals() == [0, 0, 0, 0]
        slots = [fleet.claim_slot(1), fleet.claim_slot(os.getpid())]  # pid 1 (init) is alive
        assert slots == [0, 1] and fleet.in_use() == 2
        fleet.set_count(1, 1, 1, 3)
        assert fleet.totals() == [0, 0, 0, 3] and fleet.live_workers() == 2
        assert fleet.release(1, os.getpid()) and fleet.in_use() == 2  # a high-water mark: it never shrinks
        assert fleet.totals() == [0, 0, 0, 0] and not fleet.release(1, os.getpid())
    finally:
        fleet.close()


def test_a_sweep_never_clears_a_slot_a_new_worker_just_claimed(shared: SharedFleet) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    slot = shared.claim_slot(pid)  # a worker that died since
    assert slot is not None
    # The supervisor's sweep saw the dead pid; before it releases the slot, a new worker takes it.
    assert shared.claim_slot(os.getpid()) == slot
    shared.set_count(slot, 0, 0, 1)
    assert not shared.release(slot, pid)  # under the claim lock, the pid is checked again
    assert shared.slot_pid(slot) == os.getpid() and shared.totals()[0] == 1


def test_a_word_store_writes_the_four_little_endian_bytes_a_slice_store_would(shared: SharedFleet) -> None:
    at = shared.layout.count_offset(0, 1, 1)
    shared.region.words()[at // 4] = 0x01020304
    assert bytes(shared.mm[at : at + 4]) == (0x01020304).to_bytes(4, "little")
    fallback = L._SlicedWords(shared.mm)  # what a big-endian host gets
    fallback[at // 4] = 0xA0B0C0D0
    assert bytes(shared.mm[at : at + 4]) == (0xA0B0C0D0).to_bytes(4, "little")
    assert shared.region.u32(at) == 0xA0B0C0D0
