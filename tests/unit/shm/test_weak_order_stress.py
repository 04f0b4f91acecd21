"""One writer publishes, several readers check every copy (shared memory on aarch64).

The writer is the supervisor's part: engine records and load records under their seqlock, each
carrying the generation it is published under, the header generations bumped after them, and
outcome reports into a ring. Readers, each its own process, check what the protocol promises
(``narwhal.shm.records``): a record is whole (every field derives from one generation, the CRC
agreed), an engine's generation never goes backwards, a worker's view never settles on a
generation whose records it has not seen, it reaches the last one once the writer stops, and
the ring delivers every report once, in order, whole. Bounded: about two seconds of writing.
"""

from __future__ import annotations

import os
import signal
import time

import orjson

from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.shm.layout import SLOT_RING_WRITE
from narwhal.shm.records import (
    KIND_OUTCOME,
    EngineRecord,
    LoadRecord,
    RecordBusy,
    Report,
    read_load,
    read_record,
    write_load,
    write_record,
)
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.shm.worker import WorkerFleetState

ENGINES = 4
WRITE_S = 2.0
READERS = 3
STOP_AT = 56  # a scratch u32 in the flags region's header


def _url(engine: int) -> str:
    return f"http://127.0.0.1:{engine + 1}"


def _settings() -> Settings:
    return Settings(engines=[{"name": f"e{i}", "role": "both", "url": _url(i)} for i in range(ENGINES)])


def _record(generation: int, engine: int) -> EngineRecord:
    return EngineRecord(
        version=generation, state=generation % 6, failure_streak=generation + engine,
        ejections=(generation * 3 + engine) & 0xFFFFFFFF, quarantined_until=float(generation),
        last_failure_reason="engine_5xx" if generation % 2 else "decode_silence",
        last_failure_at=generation + 0.5, name_hash=record_hash(f"e{engine}", _url(engine)),
    )


def _load(generation: int, engine: int) -> LoadRecord:
    return LoadRecord(float(generation), float(engine), generation * 2.0, (generation % 100) / 100,
                      record_hash(f"e{engine}", _url(engine)), ours=float(generation + engine))


def _writer(shared: SharedFleet, slot: int) -> None:
    end = time.monotonic() + WRITE_S
    seq = 0
    while time.monotonic() < end:
        generation = shared.generation + 1
        for engine in range(ENGINES):
            write_record(shared.region, engine, _record(generation, engine))
            write_load(shared.region, engine, _load(generation, engine), version=shared.load_generation + 1)
        shared.bump_generation()
        shared.bump_load_generation()
        report = Report(seq=0, at=float(seq), producer=seq % 7, consumer=seq % 5, failed=seq % 3, reason=1,
                        flags=1, kind=KIND_OUTCOME)
        if shared.append(slot, report):
            seq += 1


def _check_records(shared: SharedFleet, view: WorkerFleetState, seen: list[int]) -> list[str]:
    bad: list[str] = []
    for engine in range(ENGINES):
        try:
            rec, load = read_record(shared.region, engine), read_load(shared.region, engine)
        except RecordBusy:
            continue
        if rec is not None:
            if rec != _record(rec.version, engine):
                bad.append(f"torn record {rec}")
            if rec.version < seen[engine]:
                bad.append(f"e{engine} went back from {seen[engine]} to {rec.version}")
            seen[engine] = max(seen[engine], rec.version)
        if load is not None and load != _load(int(load.read_at), engine):
            bad.append(f"torn load {load}")
    records = view.records()
    settled = view._generation  # what the worker believes it has fully read
    if settled > 0 and any(r is None or r.version < settled for r in records):
        bad.append(f"the view settled on {settled} with {[r and r.version for r in records]}")
    return bad


def _reader(shared: SharedFleet, flags: SharedFleet, slot: int) -> dict[str, object]:
    view = WorkerFleetState(shared, slot, Fleet(_settings()))
    seen = [0] * ENGINES
    bad: list[str] = []
    reads = 0
    while not flags.region.u32(STOP_AT):
        bad.extend(_check_records(shared, view, seen))
        reads += 1
    final = shared.generation
    end = time.monotonic() + 2.0
    while time.monotonic() < end and [r and r.version for r in view.records()] != [final] * ENGINES:
        pass
    if [r and r.version for r in view.records()] != [final] * ENGINES:
        bad.append(f"the view never reached generation {final}")
    return {"reads": reads, "bad": bad[:5], "distinct": seen[0]}


def _drainer(shared: SharedFleet, flags: SharedFleet, slot: int) -> dict[str, object]:
    got = 0
    bad: list[str] = []
    end = time.monotonic() + WRITE_S + 10  # a report that never came whole ends it: it shows as bad
    while time.monotonic() < end:
        stopping = flags.region.u32(STOP_AT)
        for r in shared.drain(slot):
            if r.seq != got or (r.at, r.producer, r.consumer, r.failed) != (float(got), got % 7, got % 5, got % 3):
                bad.append(f"report {got} came as {r}")
            got += 1
        if stopping and shared.region.u64(shared.layout.slot_offset(slot) + SLOT_RING_WRITE) == got:
            break
    else:
        bad.append(f"reports stopped at {got}")
    return {"reports": got, "bad": bad[:5]}


def _fork(run: object, *args: object) -> tuple[int, int]:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            out = run(*args)  # type: ignore[operator]
            os.write(wfd, orjson.dumps(out))
        finally:
            os._exit(0)
    os.close(wfd)
    return pid, rfd


def _collect(pid: int, fd: int) -> dict[str, object]:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    os.waitpid(pid, 0)
    return dict(orjson.loads(b"".join(chunks)))


def test_one_writer_and_several_readers_never_disagree_on_a_record_or_a_report() -> None:
    shared = SharedFleet.create(engines=ENGINES, slots=READERS + 2, ring=8)
    flags = SharedFleet.create(engines=1, slots=1, ring=1)
    fleet = Fleet(_settings())
    shared.assign_engines([(e.name, e.url) for e in fleet.engines])  # what the master does at start
    ring_slot = shared.claim_slot(os.getpid())
    assert ring_slot is not None
    readers = [_fork(_reader, shared, flags, ring_slot + 1 + i) for i in range(READERS)]
    drainer = _fork(_drainer, shared, flags, ring_slot)
    writer = os.fork()
    if writer == 0:
        try:
            _writer(shared, ring_slot)
        finally:
            os._exit(0)
    try:
        os.waitpid(writer, 0)
    finally:
        flags.region.set_u32(STOP_AT, 1)
    results = [_collect(pid, fd) for pid, fd in readers]
    ring = _collect(*drainer)
    try:
        for result in results:
            assert result["bad"] == [], result
            assert int(str(result["reads"])) > 100 and int(str(result["distinct"])) > 10, result
        assert ring["bad"] == [] and int(str(ring["reports"])) > 100, ring
    finally:
        for pid, _ in [*readers, drainer]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shared.close()
        flags.close()
