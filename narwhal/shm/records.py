"""Checksummed records in the shared region: engine breaker state, engine load, outcome reports.

Correct without x86's ordering (GH200 and GB200 hosts are aarch64). CPython emits no
memory fences: on aarch64 another process may see one process's stores in any order, and its
own loads may be reordered too. Two guards, together, make a record read exact anyway:

* **A seqlock whose generation brackets the record.** An engine or load record is framed as
  ``seq u64 | body | crc32``. Its one writer makes ``seq`` odd, writes body and CRC in one
  copy, then makes ``seq`` even again (:func:`write_framed`). A reader copies ``seq``, skips an
  odd one, copies body and CRC, copies ``seq`` again and retries when it moved
  (:func:`read_framed`). The CRC is taken over the final even ``seq`` *and* the body, so a body
  is accepted only under the very generation it was written for: a reader that saw the new
  ``seq`` before the new body (the stores arrived out of order) finds the old body's CRC wrong
  for it and reads again, instead of taking a stale record for the new one.
* **The CRC32 itself.** Without fences the bracket alone proves nothing about the bytes
  between its two reads: a reordered copy can still mix two writes. The CRC catches any such
  mix (a false pass is a 2^-32 chance per torn copy, and a torn copy is already rare), and the
  bracket is what makes "checksum right" mean "this generation", not "some generation".

What this does not give: *when* a store becomes visible. A reader may see the previous
generation, whole, for a while (microseconds in practice); it never sees a mix, never a body
under a generation it was not written for, and it retries only a bounded number of times
(:class:`RecordBusy`: the caller keeps what it had, e.g. a writer was stopped mid-write).
A header generation bumped *after* the records (``SharedFleet.generation``) can likewise be
seen before them, so every record carries the generation it was published under
(``EngineRecord.version``, the load record's version) and a worker keeps re-reading until the
records it uses carry the generation it saw (``shm.worker``). A writer killed mid-write
leaves ``seq`` odd: the next writer steps over it, and a restarting supervisor (no writer
alive) accepts the body if its CRC matches either neighbouring generation.

Outcome reports need no bracket: a ring entry is written once per ring position and round,
and carries its own sequence number (the ring index it was written at) inside the CRC; the
reader accepts entry ``i`` only with seq ``i`` and a good CRC, so a write index seen before its
entry, or an entry of the previous round, waits for the next drain. The worker never reuses a
position before the supervisor's read index passed it, and the supervisor stores that index
only after its checks on the copied entries succeeded: a store that depends on what was
loaded is not made visible before that load on aarch64 (no speculative stores).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

from narwhal.reasons import RING_CODE, RING_NAMES
from narwhal.shm.layout import Region

# Reason codes of reports and records: the one table's ring codes (frozen, see narwhal.reasons).
REASONS: tuple[str, ...] = RING_NAMES
REASON_CODE: dict[str, int] = RING_CODE

NONE16 = 0xFFFF

# ---------------------------------------------------------------------------------- framing

_SEQ_BYTES = 8
_CRC = struct.Struct("<I")
_MAX_TRIES = 64
_NEVER = bytes(_SEQ_BYTES)


class RecordBusy(Exception):
    """A record could not be read whole in :data:`_MAX_TRIES` copies (its writer is mid-write,
    or was stopped there): the caller keeps what it read before and tries again later."""


def write_framed(region: Region, start: int, body: bytes) -> int:
    """Write ``body`` at ``start`` under the seqlock (the module's docstring); the generation."""
    mm = region.mm
    seq = int.from_bytes(mm[start : start + _SEQ_BYTES], "little")
    seq += seq & 1  # a writer stopped mid-write left it odd: its half is abandoned
    done = (seq + 2).to_bytes(_SEQ_BYTES, "little")
    mm[start : start + _SEQ_BYTES] = (seq + 1).to_bytes(_SEQ_BYTES, "little")
    mm[start + _SEQ_BYTES : start + _SEQ_BYTES + len(body) + 4] = body + _CRC.pack(zlib.crc32(done + body))
    mm[start : start + _SEQ_BYTES] = done
    return seq + 2


def read_framed(region: Region, start: int, size: int, *, writer_gone: bool = False) -> bytes | None:
    """The ``size`` bytes of body at ``start``; None if never written; :class:`RecordBusy` if no
    copy came out whole. ``writer_gone``: no writer is alive (a supervisor starting), so an odd
    generation is a dead writer's and the body counts if it is whole for either neighbour."""
    mm = region.mm
    body_at = start + _SEQ_BYTES
    for _ in range(_MAX_TRIES):
        before = mm[start:body_at]
        if before == _NEVER:
            return None
        raw = mm[body_at : body_at + size + 4]
        if mm[start:body_at] != before:
            continue
        body, crc = raw[:size], _CRC.unpack_from(raw, size)[0]
        seq = int.from_bytes(before, "little")
        if not seq & 1:
            if zlib.crc32(before + body) == crc:
                return body
        elif writer_gone:
            if any(zlib.crc32(near.to_bytes(_SEQ_BYTES, "little") + body) == crc for near in (seq - 1, seq + 1)):
                return body
            if seq == 1:
                return None  # the first write never finished: there never was a whole record
            break
    raise RecordBusy(start)


# ---------------------------------------------------------------------------------- engines

_RECORD = struct.Struct("<QBBHIIddI")  # version, state, flags, reason, streak, ejections, q_until, failed_at, name
RECORD_BYTES = _SEQ_BYTES + _RECORD.size + 4


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """An engine's breaker state as the supervisor published it; ``name_hash`` says whose it is."""

    version: int  # the header generation it was published under (shm.worker waits for it)
    state: int
    failure_streak: int
    ejections: int
    quarantined_until: float | None  # Unix seconds
    last_failure_reason: str | None
    last_failure_at: float | None  # Unix seconds
    name_hash: int
    flags: int = 0  # RECORD_BY_OPERATOR | RECORD_WAITING_FOR_WAVE | RECORD_UNREACHABLE | RECORD_KV_EVENTS


RECORD_BY_OPERATOR = 1
RECORD_WAITING_FOR_WAVE = 2
RECORD_UNREACHABLE = 4  # its last connection attempt failed (supervisor.reachability, docs/behaviour.md "Recovery")
RECORD_KV_EVENTS = 8  # its holdings follow its KV-cache events, in order (supervisor.kv_events)


def _opt(value: float) -> float | None:
    return None if math.isnan(value) else value


def write_record(region: Region, engine: int, rec: EngineRecord) -> None:
    """Supervisor only: publish the record at engine slot ``engine`` under its seqlock."""
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
    write_framed(region, region.layout.record_offset(engine), payload)


def read_record(region: Region, engine: int, *, writer_gone: bool = False) -> EngineRecord | None:
    """The engine's record, or None if none was ever written (:class:`RecordBusy`: try later)."""
    payload = read_framed(region, region.layout.record_offset(engine), _RECORD.size, writer_gone=writer_gone)
    if payload is None:
        return None
    version, state, flags, reason, streak, ejections, q_until, failed_at, nhash = _RECORD.unpack(payload)
    reason_name = REASONS[reason] if reason < len(REASONS) else ""
    return EngineRecord(
        version, state, streak, ejections, _opt(q_until), reason_name or None, _opt(failed_at), nhash, flags
    )


# ---------------------------------------------------------------------------------- load

_LOAD = struct.Struct("<QdddddI")  # version, read_at (monotonic s), running, waiting, kv_usage (NaN: none), ours, name
LOAD_BYTES = _SEQ_BYTES + _LOAD.size + 4


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """An engine's last ``/metrics`` reading (docs/behaviour.md "Placement"), written only by the supervisor.

    ``read_at`` is ``time.monotonic()``: one clock for every process of the host, so a worker
    judges the reading's age without a wall clock that may step."""

    read_at: float
    running: float
    waiting: float
    kv_usage: float | None
    name_hash: int
    ours: float = 0.0  # this host's in-flight legs on the engine (both phases) when the answer came
    version: int = field(default=0, compare=False)  # the load generation it was published under


def write_load(region: Region, engine: int, rec: LoadRecord, version: int) -> None:
    """Supervisor only: publish the reading at engine slot ``engine``, stamped with load generation ``version``."""
    payload = _LOAD.pack(
        version, rec.read_at, rec.running, rec.waiting, math.nan if rec.kv_usage is None else rec.kv_usage,
        rec.ours, rec.name_hash,
    )
    write_framed(region, region.layout.load_offset(engine), payload)


def read_load(region: Region, engine: int) -> LoadRecord | None:
    """The engine's last reading, or None if there never was one (:class:`RecordBusy`: try later)."""
    payload = read_framed(region, region.layout.load_offset(engine), _LOAD.size)
    if payload is None:
        return None
    version, read_at, running, waiting, kv, ours, nhash = _LOAD.unpack(payload)
    return LoadRecord(read_at, running, waiting, _opt(kv), nhash, ours, version)


# ---------------------------------------------------------------------------------- reports

# Kinds, like ring codes, never move (a reload runs new workers beside an older supervisor,
# which ignores a kind it does not know); a new one takes the next free number.
KIND_OUTCOME = 0
KIND_EJECT = 1
KIND_READMIT = 2
KIND_DRAIN = 3
# an outcome of a local decode: proves nothing about a producer (docs/behaviour.md "Placement", "Recovery")
KIND_LOCAL_OUTCOME = 4

FLAG_OK = 1
FLAG_COUNTS = 2
FLAG_BEFORE_TOKEN = 4
FLAG_PREFILL = 8  # the failed leg was the prefill (else decode)
FLAG_CONNECT = 16  # no connection could be made to the failed engine (stored as the byte's top bit)

_ENTRY = struct.Struct("<QdHHHBBxxxx")  # seq, at (monotonic), producer, consumer, failed, reason, flags, kind
_ENTRY_CRC = _CRC
ENTRY_BYTES = _ENTRY.size + 4


class Report(NamedTuple):
    """One ring entry: an outcome or an operator command, engines by engine slot. A named tuple,
    not a frozen dataclass: every request makes one in its worker and one in the supervisor,
    and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    seq: int
    at: float
    producer: int
    consumer: int
    failed: int  # NONE16 when nothing failed
    reason: int
    flags: int
    kind: int


def pack_report(report: Report, seq: int) -> bytes:
    """The entry's bytes for ring index ``seq`` (whatever ``report.seq`` says), its CRC over the
    payload and ``seq``."""
    payload = _ENTRY.pack(
        seq, report.at, report.producer, report.consumer, report.failed, report.reason,
        (report.flags & 0x0F) | (0x80 if report.flags & FLAG_CONNECT else 0) | (report.kind << 4),
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
    connect = FLAG_CONNECT if flags & 0x80 else 0
    return Report(seq, at, producer, consumer, failed, reason, (flags & 0x0F) | connect, (flags >> 4) & 0x07)
