"""The engine table: which engine each engine slot of the shared region belongs to.

Everything in shared memory that is per engine — its breaker record, its load record, the
in-flight and unsent-decode counts in every worker slot, the ring reports' engine fields, the
cap locks — is keyed by the engine's *slot* in this table, never by its position in a process's
engine list. An engine's identity is its name and URL.

Invariant: an identity keeps its slot for as long as any live process may refer to it, and a
slot is never given to another identity while one may. Why: a SIGHUP reload that
removed an engine shifted the positions of the engines after it; old workers still streaming
reported position ``i``, and the new supervisor charged those reports, failure streaks,
ejections and caps to whichever engine was now ``i``. Keyed by slot, an old worker's report
lands on the engine it used, under the new supervisor too; a report on a removed engine's slot
matches no engine of the new list and is dropped.

* Written by the gunicorn master, in :meth:`EngineTable.assign`, at start and at each
  reload, before it forks the processes that will read it: kept identities keep their slots,
  new ones take a free slot, removed ones are *retired* (their slot is still theirs).
* With discovery on (docs/behaviour.md "Engines that come and go"), also by the supervisor at run time:
  :meth:`EngineTable.spare_slot` and :meth:`EngineTable.make_live` give a discovered engine a
  slot, :meth:`EngineTable.retire` retires a drained one, each moving the epoch.
  **One writer at a time**: every write of the table (and of its descriptors,
  ``shm.descriptors``) is made under the table lock (``layout.TABLE_LOCK``, a ``lockf`` on the
  memfd), which the master's reload takes too; a writer reads the table
  again under the lock, so neither works on what the other has just changed.
* A retired slot goes to another identity only once every live worker started after it was
  retired: the table's epoch moves at each reload that retires a slot, and each worker notes
  in its slot the epoch it mapped its engines at (``SLOT_TABLE_EPOCH``). By then the counts of
  every worker that used the removed engine were cleared with its worker slot, and the stale
  breaker and load records at the slot carry the old identity's hash, which no reader takes.
* No room (every slot live, or retired and possibly still used): the reload is refused with
  one line, the running settings kept.
* Readers (workers at start-up, the supervisor) look identities up once; an entry's mapping
  never changes while they live, so they keep it. Entries are seqlock-framed like every
  multi-field record (``shm.records``).
* At run time (discovery), a worker follows the table (``worker.roster_follow``): when the
  epoch moved it builds its roster again from the LIVE entries and their descriptors, and
  notes in its slot the epoch it read *only once it holds nothing on any slot retired up to
  then* (no leg in flight there; until then it notes one less than that slot's retirement).
  So the rule above holds at run time too: a retired slot is reused only when every live
  worker has let go of the engine that had it.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from narwhal.shm import layout as L
from narwhal.shm.records import RecordBusy, read_framed, write_framed

FREE, LIVE, RETIRED = 0, 1, 2
_ENTRY = struct.Struct("<QIB3x")  # identity, epoch (at which it was assigned or retired), state
_BUSY_TRIES = 1000


class TableFull(Exception):
    """No slot for a new engine: every slot is live, or retired and maybe still in use."""


@functools.lru_cache(maxsize=4096)  # pure, and asked for each load read (320 a second at 32 engines)
def identity(name: str, url: str) -> int:
    """An engine's identity, 64 bits: two engines of one host never collide in practice."""
    return int.from_bytes(hashlib.blake2b(f"{name}\0{url}".encode(), digest_size=8).digest(), "little")


def record_hash(name: str, url: str) -> int:
    """The identity as the 32 bits that breaker and load records carry (``name_hash`` fields)."""
    return identity(name, url) & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Entry:
    """One table slot: whose it is (``identity``), the epoch it was assigned or retired at, FREE/LIVE/RETIRED."""

    identity: int
    epoch: int
    state: int


class EngineTable:
    """The engine slots' owners; written under the table lock only, read without a lock."""

    def __init__(self, region: L.Region) -> None:
        self.region = region
        self.size = region.layout.engines

    @property
    def epoch(self) -> int:
        """Moved by a reload that retires a slot and by each run-time write; a worker that sees it move reads again."""
        return self.region.u32(L.TABLE_EPOCH_OFFSET)

    def entry(self, slot: int) -> Entry:
        """Slot ``slot``'s entry (FREE: never written); a write under way waited out, a dead writer's judged by CRC."""
        for _ in range(_BUSY_TRIES):  # the master writes for microseconds, once per reload
            try:
                body = read_framed(self.region, self.region.layout.table_offset(slot), _ENTRY.size)
            except RecordBusy:
                continue
            return Entry(0, 0, FREE) if body is None else Entry(*_ENTRY.unpack(body))
        body = read_framed(self.region, self.region.layout.table_offset(slot), _ENTRY.size, writer_gone=True)
        return Entry(0, 0, FREE) if body is None else Entry(*_ENTRY.unpack(body))

    def lookup(self, ident: int) -> int | None:
        """The slot of ``ident`` (live, or retired while its users live on), None if it has none."""
        return self.mapping().get(ident)

    def mapping(self) -> dict[int, int]:
        """Every identity that has a slot (live or retired), and its slot: one pass of the table."""
        out: dict[int, int] = {}
        for slot in range(self.size):
            entry = self.entry(slot)
            if entry.state != FREE:
                out[entry.identity] = slot
        return out

    def assign(self, identities: Sequence[int], oldest_worker_epoch: int | None) -> list[int]:
        """Master only: a slot for each identity, in order (:class:`TableFull` when one has none).
        ``oldest_worker_epoch``: the lowest table epoch of any live worker (None: no worker)."""
        entries = [self.entry(slot) for slot in range(self.size)]
        held = {e.identity: slot for slot, e in enumerate(entries) if e.state != FREE}
        wanted = set(identities)
        retiring = [slot for slot, e in enumerate(entries) if e.state == LIVE and e.identity not in wanted]
        epoch = self.epoch + (1 if retiring else 0)
        # Free slots first, then retired ones no live worker can still refer to.
        spare = [slot for slot, e in enumerate(entries) if e.state == FREE]
        spare += [slot for slot, e in enumerate(entries) if e.state == RETIRED and e.identity not in wanted
                  and oldest_worker_epoch is not None and e.epoch <= oldest_worker_epoch]
        if oldest_worker_epoch is None:  # nobody refers to anything: every retired slot is spare
            spare += [slot for slot, e in enumerate(entries) if e.state == RETIRED and e.identity not in wanted]
        out: list[int] = []
        writes: dict[int, Entry] = {slot: Entry(entries[slot].identity, epoch, RETIRED) for slot in retiring}
        for ident in identities:
            slot = held.get(ident)
            if slot is None:
                if not spare:
                    raise TableFull(f"no engine slot left for a new engine ({self.size} in the shared layout, "
                                    "removed engines' slots still used by running workers)")
                slot = spare.pop(0)
            if entries[slot] != Entry(ident, entries[slot].epoch, LIVE):
                writes[slot] = Entry(ident, epoch, LIVE)
            out.append(slot)
        for slot, entry in writes.items():
            write_framed(self.region, self.region.layout.table_offset(slot),
                         _ENTRY.pack(entry.identity, entry.epoch, entry.state))
        self.region.set_u32(L.TABLE_EPOCH_OFFSET, epoch)
        return out


    def spare_slot(self, ident: int, oldest_worker_epoch: int | None) -> int:
        """Run-time writer, under the table lock: where one more identity goes (its own slot if
        it has one, else a free one, else a retired one no live worker refers to); nothing is
        written: the caller writes the descriptor and the record there, then :meth:`make_live`."""
        entries = [self.entry(slot) for slot in range(self.size)]
        mine = [slot for slot, e in enumerate(entries) if e.state != FREE and e.identity == ident]
        spare = mine + [slot for slot, e in enumerate(entries) if e.state == FREE]
        spare += [slot for slot, e in enumerate(entries) if e.state == RETIRED
                  and (oldest_worker_epoch is None or e.epoch <= oldest_worker_epoch)]
        if not spare:
            raise TableFull(f"no engine slot left for a new engine ({self.size} in the shared layout, "
                            "drained engines' slots still used by running workers)")
        return spare[0]

    def make_live(self, slot: int, ident: int) -> None:
        """Run-time writer, under the table lock: ``slot`` is ``ident``'s from now on; the epoch moves."""
        epoch = self.epoch + 1
        write_framed(self.region, self.region.layout.table_offset(slot), _ENTRY.pack(ident, epoch, LIVE))
        self.region.set_u32(L.TABLE_EPOCH_OFFSET, epoch)

    def retire(self, slot: int) -> None:
        """Run-time writer, under the table lock: the engine at ``slot`` is gone; the epoch moves."""
        entry = self.entry(slot)
        if entry.state != LIVE:
            return
        epoch = self.epoch + 1
        write_framed(self.region, self.region.layout.table_offset(slot), _ENTRY.pack(entry.identity, epoch, RETIRED))
        self.region.set_u32(L.TABLE_EPOCH_OFFSET, epoch)


def worker_epoch(table: EngineTable, slots: Iterable[int]) -> int:
    """The epoch a worker notes in its slot: the table's, or older if it maps a slot already
    retired (a reload between its fork and its look-up), so that slot is not reused under it."""
    epoch = table.epoch
    for slot in slots:
        entry = table.entry(slot)
        if entry.state == RETIRED:
            epoch = min(epoch, entry.epoch - 1)
    return max(epoch, 0)
