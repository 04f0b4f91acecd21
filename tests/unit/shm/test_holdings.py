"""The holdings region (docs/behaviour.md "Placement"): sections one writer publishes and workers read lock-free,
stamped with the engine's identity; the prefill rings workers report to."""

from __future__ import annotations

import os
import struct

from narwhal.shm.holdings import SECTION_HEAD, Holdings, HoldingsLayout, PrefillReport, engine_id_hash, section_stamp
from narwhal.shm.holdings_view import HoldingsReader, WorkerHoldings

P0 = section_stamp("p0", "http://10.0.0.1:8100")


def _region(**kw: int) -> Holdings:
    return Holdings.create(HoldingsLayout(**{"sections": 2, "keys": 8, "slots": 2, "ring": 4, "entry_keys": 4,
                                             **kw}))


def test_a_published_section_reads_back_for_its_engine_only() -> None:
    h = _region()
    assert h.read(0, P0) is None  # never written
    h.publish(0, P0, 77, [3, 2, 1], 1000, 250_000.0, 3.9, 1200.0)
    held = h.read(0, P0)
    assert held is not None
    assert (held.keys, held.blocks, held.capacity_blocks, held.prefill_chars_per_s, held.chars_per_token,
            held.mean_uncached_chars, held.engine_id) == (frozenset({1, 2, 3}), 3, 1000, 250_000.0, 3.9, 1200.0, 77)
    # Another engine list's section (a reload moved p0's index): not this engine's.
    assert h.read(0, section_stamp("p0", "http://10.0.0.2:8100")) is None
    h.publish(0, P0, 77, list(range(20)), None, None, None, 0.0)
    again = h.read(0, P0)
    assert again is not None and again.blocks == 8 and again.capacity_blocks is None  # cut to the room


def test_a_sections_token_keys_read_back_in_their_own_room_and_are_covered_by_its_crc() -> None:
    h = _region(token_keys=4)
    h.publish(0, P0, 77, [3, 2, 1], None, None, None, 0.0, token_keys=[9, 8, 7, 6, 5], block_tokens=16)
    held = h.read(0, P0)
    assert held is not None
    assert (held.keys, held.token_keys, held.block_tokens) == (frozenset({1, 2, 3}), frozenset({9, 8, 7, 6}), 16)
    h.publish(0, P0, 77, [3], None, None, None, 0.0)  # not followed (any more): no token keys
    again = h.read(0, P0)
    assert again is not None and (again.token_keys, again.block_tokens) == (frozenset(), 0)
    h.publish(0, P0, 77, [3], None, None, None, 0.0, token_keys=[9], block_tokens=16)
    at = h.layout.section_offset(0) + SECTION_HEAD + h.layout.keys * 8
    h.mm[at : at + 8] = struct.pack("<Q", 99)  # a token key changed, CRC not
    assert h.read(0, P0) is None


def test_a_torn_section_is_not_read_as_holdings() -> None:
    h = _region()
    h.publish(0, P0, 1, [5, 6], None, None, None, 0.0)
    off = h.layout.section_offset(0)
    h.mm[off + SECTION_HEAD : off + SECTION_HEAD + 8] = struct.pack("<Q", 99)  # a key changed, CRC not
    assert h.read(0, P0) is None
    h.publish(0, P0, 1, [5, 6], None, None, None, 0.0)
    seq = int.from_bytes(h.mm[off : off + 8], "little")
    h.mm[off : off + 8] = (seq | 1).to_bytes(8, "little")  # being written
    assert h.read(0, P0) is None


def test_the_reader_decodes_a_section_again_only_when_it_moved() -> None:
    h = _region()
    reader = HoldingsReader(h, [P0, section_stamp("d0", "http://10.0.0.3:8200")])
    assert reader.current() == [None, None]
    h.publish(0, P0, 1, [5], None, None, None, 0.0)
    first = reader.current()[0]
    assert first is not None and first.keys == frozenset({5})
    assert reader.current()[0] is first  # nothing published since: the same object, no decode
    h.publish(0, P0, 1, [6, 5], None, None, None, 0.0)
    moved = reader.current()[0]
    assert moved is not None and moved.keys == frozenset({5, 6})


def test_a_reader_that_meets_a_section_mid_write_keeps_what_it_had_and_reads_it_again() -> None:
    """A writer descheduled mid-section (its sequence odd at every try, on a busy 2-core host)
    must not make a worker believe the producer holds nothing until the next publish: the reader
    keeps its last holdings and looks again at the next placement (a full-suite flake of
    test_holdings_sharing: a repeated prefix predicted 0 cached characters)."""
    h = _region()
    reader = HoldingsReader(h, [P0])
    h.publish(0, P0, 1, [5], None, None, None, 0.0)
    first = reader.current()[0]
    assert first is not None and first.keys == frozenset({5})
    h.publish(0, P0, 1, [6, 5], None, None, None, 0.0)
    off = h.layout.section_offset(0)
    seq = int.from_bytes(h.mm[off : off + 8], "little")
    h.mm[off : off + 8] = (seq | 1).to_bytes(8, "little")  # the next write under way at every try
    assert reader.current()[0] is first  # kept, not None
    h.mm[off : off + 8] = seq.to_bytes(8, "little")  # the write ended: no new generation needed
    moved = reader.current()[0]
    assert moved is not None and moved.keys == frozenset({5, 6})


def test_reports_travel_the_ring_in_order_and_a_full_ring_drops_without_blocking() -> None:
    h = _region()
    worker = WorkerHoldings(h, [P0, 0], slot=1)
    for i in range(5):
        worker.report_prefill(0, "engine-a", 1000 + i, 250, 64 if i else None, 0.01, [i, i + 1, i + 2, i + 3, i + 4])
    assert worker.dropped == 1  # ring of 4
    reports = h.drain(1)
    assert [r.prompt_chars for r in reports] == [1000, 1001, 1002, 1003]
    assert reports[0] == PrefillReport(0, P0, engine_id_hash("engine-a"), 1000, 250, None, 0.01, (0, 1, 2, 3))
    assert reports[1].cached_tokens == 64  # keys cut to the entry's room (4)
    assert h.drain(1) == [] and h.drain(0) == []
    worker.report_prefill(0, None, 10, None, None, 0.0, [])
    assert [r.engine_id for r in h.drain(1)] == [0]


def test_a_stale_entry_of_an_earlier_lap_is_not_read() -> None:
    h = _region()
    h.report(0, PrefillReport(0, P0, 0, 1, None, None, 0.0, (1,)))
    assert len(h.drain(0)) == 1
    base = h.layout.ring_offset(0)
    h.mm[base : base + 8] = (2).to_bytes(8, "little")  # a write index ahead of an entry never written
    assert h.drain(0) == []


def test_the_region_is_inherited_across_fork() -> None:
    h = _region()
    pid = os.fork()
    if pid == 0:
        h.publish(1, P0, 5, [42], None, None, None, 0.0)
        os._exit(0)
    os.waitpid(pid, 0)
    held = h.read(1, P0)
    assert held is not None and held.keys == frozenset({42})


def test_prefill_work_in_flight_is_summed_over_workers_and_cleared_with_a_dead_slot() -> None:
    h = _region()
    one, two = WorkerHoldings(h, [P0, 0], slot=0), WorkerHoldings(h, [P0, 0], slot=1)
    one.add_work(0, 300)
    two.add_work(0, 200)
    two.add_work(1, 50)
    assert one.work() == [500, 50]
    one.add_work(0, -300)
    assert two.work() == [200, 50]
    h.skip(1)  # its worker died
    assert one.work() == [0, 0]


def test_a_report_carries_when_it_finished_for_the_merge_across_workers() -> None:
    h = _region()
    WorkerHoldings(h, [P0, 0], slot=1).report_prefill(0, None, 10, None, None, 0.0, [], 0, at=12.5)
    WorkerHoldings(h, [P0, 0], slot=0).report_prefill(0, None, 11, None, None, 0.0, [], 0, at=12.25)
    merged = sorted(h.drain(0) + h.drain(1), key=lambda r: r.at)
    assert [(r.prompt_chars, r.at) for r in merged] == [(11, 12.25), (10, 12.5)]


def test_a_section_seen_under_a_newer_seq_than_its_body_was_written_for_is_not_taken() -> None:
    # On aarch64 a reader can see the new even seq before the new body. The CRC
    # covers the seq it was published under (as shm.records' do), so the old body is refused.
    h = _region()
    h.publish(1, P0, 5, [42], None, None, None, 0.0)
    off = h.layout.section_offset(1)
    assert h.read(1, P0) is not None
    seq = h.section_seq(1)
    h.mm[off : off + 8] = (seq + 2).to_bytes(8, "little")  # the next generation's seq, the old body
    assert h.read(1, P0) is None


def test_a_generation_seen_before_its_section_is_read_again() -> None:
    """aarch64 (docs/behaviour.md): a worker may see the generation's bump before the section it
    counts. It must not take the generation as seen with the old section, or it keeps stale
    holdings until the next publish."""
    h = _region()
    reader = HoldingsReader(h, [P0])
    h.publish(0, P0, 1, [5], None, None, None, 0.0)
    assert reader.current()[0] is not None
    off = h.layout.section_offset(0)
    old = bytes(h.mm[off : off + h.layout.section_offset(1) - off])
    h.publish(0, P0, 1, [6, 5], None, None, None, 0.0)
    new = bytes(h.mm[off : off + len(old)])
    h.mm[off : off + len(old)] = old  # the bump is visible, the section's new write not yet
    stale = reader.current()[0]
    assert stale is not None and stale.keys == frozenset({5})
    h.mm[off : off + len(new)] = new  # the write arrives; the generation does not move again
    fresh = reader.current()[0]
    assert fresh is not None and fresh.keys == frozenset({5, 6})
