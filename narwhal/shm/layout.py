"""The fixed layout of the fleet state shared by the supervisor and every worker.

One memfd, sized once in the gunicorn master before any fork and mapped ``MAP_SHARED``:
workers and the supervisor inherit both the descriptor and the mapping, so there is no
name to leak, no resource tracker (``multiprocessing.shared_memory`` on Python 3.11 has
one that unlinks segments behind your back), and nothing left behind after ``kill -9`` of
any process: the memory goes when the last process holding it exits.

::

    header                      64 B   magic, sizes, supervisor pid + heartbeat, generations,
                                       slots in use
    engine records   E ×       64 B   seq, breaker state, CRC: written only by the supervisor
    load records     E ×       64 B   seq, what each engine's /metrics said and when, CRC (supervisor)
    engine table     E ×       32 B   seq, identity (name + URL), state, epoch, CRC: which engine
                                       each engine slot is (the master; the supervisor at run time
                                       once discovery is on; ``shm.table``)
    descriptors      E ×     1024 B   seq, length, the engine's description as JSON, CRC: what a
                                       worker needs to build an engine it was never configured
                                       with (``shm.descriptors``; written with the table entry)
    models generation           64 B   u64 bumped by the supervisor after each round of model records
    model records    E ×     2048 B   seq, the engine's models from its /v1/models, CRC: written
                                       only by the supervisor, read by workers (``shm.models``)
    worker slots     W × (64 B + E·8 B + E·4 B (to 8) + R·RING_ENTRY)
        slot header                    pid, requests and retries in flight, ring indices,
                                       client connections, the table epoch it mapped engines at
        in-flight counts               u32 per engine slot and phase, written only by that worker
        unsent decodes                 u32 per engine slot: of its decode slots, those reserved with
                                       a pair whose decode leg is not sent yet (that worker)
        outcome ring                   R reports, written by the worker, consumed by the supervisor

Every "per engine" above is per engine *slot*, an engine's place in the engine table, which
follows its identity across reloads (``shm.table``), never its position in a settings file.

W is :data:`WORKER_SLOTS` (512) whatever ``server.workers`` is: a reload that raises the count
runs every new worker beside the old ones still draining, and each needs a slot (with
8 slots for 4 → 8 workers left new workers on per-process state for good, and an admin
``eject`` answered while some workers still used the engine). An unclaimed slot costs no
memory (the memfd's pages are allocated when first written) and no time: scans stop at the
header's "slots in use", one past the highest slot ever claimed (slots are claimed lowest
first, so it stays near twice the worker count).

One writer per field, always. Multi-field records sit under a seqlock whose generation
brackets them and carry a CRC32 over that generation and their payload (``shm.records`` says
why the pair is exact on aarch64, where CPython emits no fences): a reader that sees a torn,
reordered or not yet visible record reads again; no locks on the read path. Single aligned u32/u64 fields
need no checksum, but are written and read as one copy of their bytes (:func:`store_u32`,
:meth:`Region.u64` …), never with ``struct.pack_into``: CPython's ``pack_into`` first zeroes
the field in place, then writes it a byte at a time, so a reader in another process could see
0 or a half-written value. The heartbeat read as 0 is "never beat": a keeper that met one
killed a healthy supervisor (11,429 of 20.5 M reads against a writer beating 2,000
times a second saw a heartbeat over a second old).

The memfd also carries byte-range ``lockf`` locks (beyond its end, so they never cover data):
the only cross-process lock is the short one taken to reserve a slot of a *capped* engine,
where "a cap of 1 never holds two streams" needs check-and-increment to be one step.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar

from narwhal.settings import MAX_WORKERS

MAGIC = 0x4E52574C  # "NRWL"
VERSION = 6  # 2: unsent decodes; 3: records under a seqlock; 4: the engine table; 5: descriptors; 6: models

HEADER = struct.Struct("<IIIIIIQQQ")  # magic, version, engines, slots, ring, sup_pid, heartbeat_ns, generation, starts
HEADER_SIZE = 64
GENERATION_OFFSET = 32
HEARTBEAT_OFFSET = 24
SUPERVISOR_PID_OFFSET = 20
STARTS_OFFSET = 40
LOAD_GENERATION_OFFSET = 48  # bumped by the supervisor after each round of load readings

SLOTS_USED_OFFSET = 56  # u32: one past the highest slot ever claimed (claimers, under the claim lock)
TABLE_EPOCH_OFFSET = 60  # u32: moved by each reload that retires an engine slot (master; shm.table)

WORKER_SLOTS = 2 * MAX_WORKERS  # 512: every reload fits, old workers draining beside new ones

RECORD_SIZE = 64
LOAD_RECORD_SIZE = 64
TABLE_ENTRY_SIZE = 32
DESCRIPTOR_SIZE = 24 * 1024  # the largest [[engines]] entry the settings accept fits (shm.descriptors)
MODELS_HEADER_SIZE = 64  # the models generation (u64), alone on its line
MODELS_RECORD_SIZE = 2048
SLOT_HEADER_SIZE = 64
# slot header: pid u32, requests in flight u32, retries in flight u32, dropped reports u32,
#              ring write index u64 (worker), ring read index u64 (supervisor),
#              client connections u32 (worker; NOT_ACCEPTING while it accepts none),
#              table epoch u32 (worker: the engine table's epoch its engines were mapped at),
#              migrated streams in flight u32 (worker)
SLOT_PID = 0
SLOT_REQUESTS = 4
SLOT_RETRIES = 8
SLOT_DROPPED = 12
SLOT_RING_WRITE = 16
SLOT_RING_READ = 24
SLOT_CONNECTIONS = 32
SLOT_TABLE_EPOCH = 36
SLOT_MIGRATIONS = 40
NOT_ACCEPTING = 0xFFFFFFFF

RING_ENTRY_SIZE = 32
DEFAULT_RING = 512

# Lock byte offsets: far beyond the mapped data.
LOCK_BASE = 1 << 40
CLAIM_LOCK = LOCK_BASE - 1
TABLE_LOCK = LOCK_BASE - 2  # the engine table's one writer at a time: the master's reload, the supervisor


@dataclass(frozen=True)
class Layout:
    """The region's sizes, and where each record and slot sits; the same in every process that maps it."""

    engines: int
    slots: int
    ring: int = DEFAULT_RING

    @property
    def records_offset(self) -> int:
        """Where the engine records start, just after the header."""
        return HEADER_SIZE

    def record_offset(self, engine: int) -> int:
        """Where engine slot ``engine``'s breaker record sits."""
        return HEADER_SIZE + engine * RECORD_SIZE

    def load_offset(self, engine: int) -> int:
        """Where engine slot ``engine``'s load record sits."""
        return HEADER_SIZE + self.engines * RECORD_SIZE + engine * LOAD_RECORD_SIZE

    def table_offset(self, engine: int) -> int:
        """Where engine slot ``engine``'s table entry sits (``shm.table``)."""
        return HEADER_SIZE + self.engines * (RECORD_SIZE + LOAD_RECORD_SIZE) + engine * TABLE_ENTRY_SIZE

    def descriptor_offset(self, engine: int) -> int:
        """Where engine slot ``engine``'s descriptor sits (``shm.descriptors``)."""
        return (HEADER_SIZE + self.engines * (RECORD_SIZE + LOAD_RECORD_SIZE + TABLE_ENTRY_SIZE)
                + engine * DESCRIPTOR_SIZE)

    @property
    def models_generation_offset(self) -> int:
        """Where the models generation sits (``shm.models``), after the descriptors."""
        return HEADER_SIZE + self.engines * (RECORD_SIZE + LOAD_RECORD_SIZE + TABLE_ENTRY_SIZE + DESCRIPTOR_SIZE)

    def models_offset(self, engine: int) -> int:
        """Where engine slot ``engine``'s model record sits (``shm.models``)."""
        return self.models_generation_offset + MODELS_HEADER_SIZE + engine * MODELS_RECORD_SIZE

    @functools.cached_property
    def _unsent_size(self) -> int:
        return (self.engines * 4 + 7) // 8 * 8  # slots stay 8-byte aligned for their u64 fields

    @functools.cached_property
    def slot_size(self) -> int:
        """One worker slot's bytes: header, counts, unsent decodes, ring; a multiple of 8."""
        return SLOT_HEADER_SIZE + self.engines * 8 + self._unsent_size + self.ring * RING_ENTRY_SIZE

    @functools.cached_property
    def _slots_base(self) -> int:
        return self.models_offset(self.engines)

    def slot_offset(self, slot: int) -> int:
        """Where worker slot ``slot`` starts."""
        return self._slots_base + slot * self.slot_size

    def counts_offset(self, slot: int) -> int:
        """Where a worker slot's in-flight counts start."""
        return self.slot_offset(slot) + SLOT_HEADER_SIZE

    def count_offset(self, slot: int, engine: int, phase: int) -> int:
        """The u32 a worker slot counts legs on an engine slot in a phase (0 prefill, 1 decode) in."""
        return self.counts_offset(slot) + (engine * 2 + phase) * 4

    def unsent_offset(self, slot: int, engine: int) -> int:
        """The u32 a worker slot counts unsent decodes on an engine slot in."""
        return self.counts_offset(slot) + self.engines * 8 + engine * 4

    @property
    def slot_counts_size(self) -> int:
        """The in-flight counts and the unsent decodes of one slot: what a dead worker gives back."""
        return self.engines * 8 + self._unsent_size

    def ring_offset(self, slot: int, index: int) -> int:
        """Where ring entry ``index`` (any index: it wraps) of a worker slot sits."""
        return self.slot_offset(slot) + self.ring_start + (index % self.ring) * RING_ENTRY_SIZE

    @functools.cached_property
    def ring_start(self) -> int:
        """Where a worker slot's ring starts, from the slot's start."""
        return SLOT_HEADER_SIZE + self.slot_counts_size

    @property
    def size(self) -> int:
        """The memfd's size, whole pages: the end of the last worker slot rounded up."""
        return whole_pages(self.slot_offset(self.slots))


def whole_pages(size: int) -> int:
    """``size`` bytes rounded up to whole pages: what a memfd region is truncated to."""
    return (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class Sized(Protocol):
    """A region's layout, as :class:`Mapped` needs it: its size in bytes, whole pages."""

    @property
    def size(self) -> int:
        """The region's bytes, whole pages."""
        ...


L = TypeVar("L", bound=Sized)


class Mapped(Generic[L]):
    """A memfd mapped shared and writable, with its layout: the fleet region and the holdings
    region both. Created by the master before any fork, its header written before any other
    process can read it; the descriptor is not CLOEXEC, so every worker and the supervisor
    inherit it, and each keeps its own open (``lockf``) until :meth:`close`."""

    NAME = ""  # the memfd's name (as /proc/<pid>/fd shows it)
    _words: memoryview | _SlicedWords | None = None  # made by words(), released by close()

    def __init__(self, layout: L, fd: int, mm: mmap.mmap) -> None:
        self.layout = layout
        self.fd = fd
        self.mm = mm

    @classmethod
    def create(cls, layout: L) -> Self:
        """A new zeroed memfd of ``layout.size`` and its mapping, the header written; master only."""
        fd = os.memfd_create(cls.NAME, 0)  # inherited across fork (not CLOEXEC)
        os.ftruncate(fd, layout.size)
        mm = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        region = cls(layout, fd, mm)
        region.write_header()
        return region

    def write_header(self) -> None:
        """The region's header, written once by :meth:`create` (its magic, version and sizes)."""
        raise NotImplementedError

    def words(self) -> U32Words:
        """The region as aligned u32 words (index: byte offset // 4), kept until :meth:`close`.
        ``words[i] = value`` is one copy of the four bytes and no Python call at all, where
        :func:`store_u32` is two: the worker's per-request stores use it."""
        if self._words is None:
            self._words = memoryview(self.mm).cast("I") if sys.byteorder == "little" else _SlicedWords(self.mm)
        return self._words

    def close(self) -> None:
        """Release the word view (a live export would make ``mmap.close`` refuse), then unmap
        and close this process's descriptor; other processes keep theirs."""
        if isinstance(self._words, memoryview):
            self._words.release()
        self._words = None
        self.mm.close()
        os.close(self.fd)


class Region(Mapped[Layout]):
    """The fleet region: the mapping and its descriptor (kept open for ``lockf``)."""

    NAME = "narwhal-fleet"

    def write_header(self) -> None:
        """Magic, version and the layout's sizes; the rest of the header zero."""
        layout = self.layout
        HEADER.pack_into(self.mm, 0, MAGIC, VERSION, layout.engines, layout.slots, layout.ring, 0, 0, 0, 0)

    def u32(self, offset: int) -> int:
        """An aligned u32 read as one copy of its bytes."""
        return int.from_bytes(self.mm[offset : offset + 4], "little")

    def set_u32(self, offset: int, value: int) -> None:
        """An aligned u32 written as one copy (:func:`store_u32`); only the field's writer calls it."""
        store_u32(self.mm, offset, value)

    def u64(self, offset: int) -> int:
        """An aligned u64 read as one copy of its bytes."""
        return int.from_bytes(self.mm[offset : offset + 8], "little")

    def set_u64(self, offset: int, value: int) -> None:
        """An aligned u64 written as one copy, never ``pack_into`` (it zeroes first); only the field's writer."""
        self.mm[offset : offset + 8] = value.to_bytes(8, "little")


class U32Words(Protocol):
    """Aligned little-endian u32 words of a region, each written as one copy of its bytes."""

    def __setitem__(self, index: int, value: int) -> None:
        """Word ``index`` (byte offset // 4) becomes ``value``."""
        ...


class _SlicedWords:
    """:class:`U32Words` on a big-endian host, where a native ``"I"`` view would store the
    bytes reversed: :func:`store_u32` per word."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm

    def __setitem__(self, index: int, value: int) -> None:
        """Word ``index`` becomes ``value``, little-endian, one copy."""
        store_u32(self.mm, index * 4, value)


def store_u32(mm: mmap.mmap, offset: int, value: int) -> None:
    """One aligned u32 written as one copy of its four bytes (see the module's docstring)."""
    mm[offset : offset + 4] = value.to_bytes(4, "little")


# Precompiled, for reads (a read never zeroes anything): these run several times per request.
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
RING_INDICES = struct.Struct("<QQ")  # a slot's SLOT_RING_WRITE and SLOT_RING_READ, adjacent
