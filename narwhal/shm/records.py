"""Checksummed records in the shared region: engine breaker state, engine load, outcome reports.

A writer packs payload and CRC32 in one ``pack_into``; a reader unpacks, recomputes the CRC
and, on a mismatch, reads again (a torn or reordered write is simply not visible yet). The
CRC covers the whole payload, including a sequence number, so a stale copy of an older
record cannot pass for a newer one in a ring.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

from narwhal.reasons import RING_CODE, RING_NAMES
from narwhal.shm.layout import Region

# Reason codes of reports and records: the one table's ring codes (frozen, see narwhal.reasons).
REASONS: tuple[str, ...] = RING_NAMES
REASON_CODE: dict[str, int] = RING_CODE

NONE16 = 0xFFFF

# ---------------------------------------------------------------------------------- engines

_RECORD = struct.Struct("<QBBHIIddI")  # version, state, flags, reason, streak, ejections, q_until, failed_at, name
_RECORD_CRC = struct.Struct("<I")
RECORD_BYTES = _RECORD.size + 4
_MAX_TRIES = 64


@dataclass(frozen=True, slots=True)
class EngineRecord:
    version: int
    state: int
    failure_streak: int
    ejections: int
    quarantined_until: float | None  # Unix seconds
    last_failure_reason: str | None
    last_failure_at: float | None  # Unix seconds
    name_hash: int
    flags: int = 0  # RECORD_BY_OPERATOR | RECORD_WAITING_FOR_WAVE: what a restarted supervisor needs


RECORD_BY_OPERATOR = 1
RECORD_WAITING_FOR_WAVE = 2


def name_hash(name: str) -> int:
    return zlib.crc32(name.encode())


def _opt(value: float) -> float | None:
    return None if math.isnan(value) else value


def write_record(region: Region, engine: int, rec: EngineRecord) -> None:
    reason = REASON_CODE.get(rec.last_failure_reason or "", 0)
    payload = _RECORD.pack(
        rec.version,
        rec.state,
        rec.flags,
        reason,
        rec.failure_streak,
        rec.ejections,
        math.nan if rec.quarantined_until is None else rec.quarantined_until,
        math.nan if rec.last_failure_at is None else rec.last_failure_at,
        rec.name_hash,
    )
    region.mm[region.layout.record_offset(engine) : region.layout.record_offset(engine) + RECORD_BYTES] = (
        payload + _RECORD_CRC.pack(zlib.crc32(payload))
    )


def read_record(region: Region, engine: int) -> EngineRecord | None:
    """The engine's record, or None if the supervisor never wrote one."""
    start = region.layout.record_offset(engine)
    for _ in range(_MAX_TRIES):
        raw = region.mm[start : start + RECORD_BYTES]
        payload = raw[: _RECORD.size]
        if _RECORD_CRC.unpack_from(raw, _RECORD.size)[0] != zlib.crc32(payload):
            continue
        version, state, flags, reason, streak, ejections, q_until, failed_at, nhash = _RECORD.unpack(payload)
        if version == 0:
            return None
        reason_name = REASONS[reason] if reason < len(REASONS) else ""
        return EngineRecord(
            version, state, streak, ejections, _opt(q_until), reason_name or None, _opt(failed_at), nhash, flags
        )
    return None


# ---------------------------------------------------------------------------------- load

_LOAD = struct.Struct("<QdddddI")  # version, read_at (monotonic s), running, waiting, kv_usage (NaN: none), ours, name
LOAD_BYTES = _LOAD.size + 4
_VERSION = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """An engine's last ``/metrics`` reading (SPEC §3.2), written only by the supervisor.

    ``read_at`` is ``time.monotonic()``: one clock for every process of the host, so a worker
    judges the reading's age without a wall clock that may step."""

    read_at: float
    running: float
    waiting: float
    kv_usage: float | None
    name_hash: int
    ours: float = 0.0  # this host's in-flight legs on the engine (both phases) when the answer came


def write_load(region: Region, engine: int, rec: LoadRecord, version: int) -> None:
    payload = _LOAD.pack(
        version, rec.read_at, rec.running, rec.waiting, math.nan if rec.kv_usage is None else rec.kv_usage,
        rec.ours, rec.name_hash,
    )
    start = region.layout.load_offset(engine)
    region.mm[start : start + LOAD_BYTES] = payload + _RECORD_CRC.pack(zlib.crc32(payload))


def read_load(region: Region, engine: int) -> LoadRecord | None:
    """The engine's last reading, or None if there never was one."""
    start = region.layout.load_offset(engine)
    for _ in range(_MAX_TRIES):
        raw = region.mm[start : start + LOAD_BYTES]
        if _VERSION.unpack_from(raw)[0] == 0:
            return None  # never written (zeroed memory fails the CRC: no retries for it)
        payload = raw[: _LOAD.size]
        if _RECORD_CRC.unpack_from(raw, _LOAD.size)[0] != zlib.crc32(payload):
            continue
        version, read_at, running, waiting, kv, ours, nhash = _LOAD.unpack(payload)
        return None if version == 0 else LoadRecord(read_at, running, waiting, _opt(kv), nhash, ours)
    return None


# ---------------------------------------------------------------------------------- reports

# Kinds, like ring codes, never move (a reload runs new workers beside an older supervisor,
# which ignores a kind it does not know); a new one takes the next free number.
KIND_OUTCOME = 0
KIND_EJECT = 1
KIND_READMIT = 2
KIND_DRAIN = 3
KIND_LOCAL_OUTCOME = 4  # an outcome of a local decode: proves nothing about a producer (SPEC §3.2, §6)

FLAG_OK = 1
FLAG_COUNTS = 2
FLAG_BEFORE_TOKEN = 4
FLAG_PREFILL = 8  # the failed leg was the prefill (else decode)

_ENTRY = struct.Struct("<QdHHHBBxxxx")  # seq, at (monotonic), producer, consumer, failed, reason, flags, kind
_ENTRY_CRC = struct.Struct("<I")
ENTRY_BYTES = _ENTRY.size + 4


@dataclass(frozen=True, slots=True)
class Report:
    seq: int
    at: float
    producer: int
    consumer: int
    failed: int  # NONE16 when nothing failed
    reason: int
    flags: int
    kind: int


def pack_report(report: Report) -> bytes:
    payload = _ENTRY.pack(
        report.seq, report.at, report.producer, report.consumer, report.failed, report.reason,
        report.flags | (report.kind << 4),
    )
    return payload + _ENTRY_CRC.pack(zlib.crc32(payload))


def unpack_report(raw: bytes, expected_seq: int) -> Report | None:
    """The report, or None while it is torn, stale or not fully visible yet."""
    payload = raw[: _ENTRY.size]
    if _ENTRY_CRC.unpack_from(raw, _ENTRY.size)[0] != zlib.crc32(payload):
        return None
    seq, at, producer, consumer, failed, reason, flags = _ENTRY.unpack(payload)
    if seq != expected_seq:
        return None
    return Report(seq, at, producer, consumer, failed, reason, flags & 0x0F, flags >> 4)
