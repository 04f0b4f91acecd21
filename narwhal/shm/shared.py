"""Operations on the shared region used by the master, the workers and the supervisor.

Who writes what (one writer per field):

* master: the header's sizes at creation, the supervisor start count (it starts every
  supervisor), the engine table and its epoch (at start and each reload, before forking:
  ``shm.table``); a dead worker's slot (``child_exit``), since its only writer is gone;
* supervisor: engine records, generation, load and model records (``shm.models``) and their
  generations, heartbeat, its pid, ring read indices, and the slots of workers it finds dead;
* a worker: its own slot (pid at claim, the table epoch it mapped its engines at, counts,
  ring entries, ring write index), and the slots-in-use mark when it claims past it.

Slots are claimed and released under the claim lock only: its ``lockf`` calls are syscalls,
which order the clearing stores of a release before the next claim on any memory model.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

from narwhal.shm import descriptors
from narwhal.shm import layout as L
from narwhal.shm.records import ENTRY_BYTES, LoadRecord, Report, pack_report, unpack_report, write_load
from narwhal.shm.table import LIVE, EngineTable, identity


class SharedFleet:
    """Every process's operations on the one shared region; each field has one writer (above)."""

    def __init__(self, region: L.Region) -> None:
        self.region = region
        self.layout = region.layout
        self.mm = region.mm
        n = self.layout.engines * 2
        self._counts = struct.Struct(f"<{n}I")
        self._counts_base = self.layout.counts_offset(0)  # where totals() unpacks from, on every placement
        # by engines and slots in use, for totals(): the struct and each column's slice of what it unpacks
        self._all_counts: dict[tuple[int, int], tuple[struct.Struct, tuple[slice, ...]]] = {}
        self.table = EngineTable(region)
        # identity -> engine slot, for the engines this process uses: theirs never change while it lives
        self._engine_slots: dict[int, int] = {}

    @classmethod
    def create(cls, engines: int, slots: int, ring: int = L.DEFAULT_RING) -> SharedFleet:
        """A new region (master only, in ``on_starting``, before any fork); tests make their own."""
        return cls(L.Region.create(L.Layout(engines=engines, slots=slots, ring=ring)))

    def close(self) -> None:
        """Unmap and close the memfd; the memory goes with the last process that holds it."""
        self.region.close()

    # -- header ---------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Bumped by the supervisor after it publishes engine records; workers decode again on a move."""
        return self.region.u64(L.GENERATION_OFFSET)

    def bump_generation(self) -> None:
        """Supervisor only, after the records it changed were written (``shm.records``)."""
        self.region.set_u64(L.GENERATION_OFFSET, self.generation + 1)

    @property
    def load_generation(self) -> int:
        """Bumped by the supervisor after each round of load readings; placement reads again on a move."""
        return self.region.u64(L.LOAD_GENERATION_OFFSET)

    def bump_load_generation(self) -> None:
        """Supervisor only, after the round's load records were written."""
        self.region.set_u64(L.LOAD_GENERATION_OFFSET, self.load_generation + 1)

    def publish_loads(self, readings: Sequence[tuple[int, LoadRecord]]) -> None:
        """Supervisor's loop only: each (engine slot, load record) under the next load generation,
        then the bump, once for them all (``shm.worker`` waits for the records to carry it)."""
        if not readings:
            return
        version = self.load_generation + 1
        for at, record in readings:
            write_load(self.region, at, record, version=version)
        self.bump_load_generation()

    def beat(self, pid: int) -> None:
        """Supervisor only: proves to the master's keeper that supervisor ``pid`` is alive and not wedged."""
        # The time first: a keeper that sees a new supervisor's pid must see that supervisor's
        # beat, not its predecessor's stale one (or none at all), which would read as wedged.
        self.region.set_u64(L.HEARTBEAT_OFFSET, time.monotonic_ns())
        self.region.set_u32(L.SUPERVISOR_PID_OFFSET, pid)

    @property
    def heartbeat_age_s(self) -> float:
        """Seconds since the last beat; infinite before the first, so a keeper never reads 0 as fresh."""
        last = self.region.u64(L.HEARTBEAT_OFFSET)
        return float("inf") if last == 0 else (time.monotonic_ns() - last) / 1e9

    @property
    def supervisor_pid(self) -> int:
        """The pid of the supervisor that beat last (0: none yet)."""
        return self.region.u32(L.SUPERVISOR_PID_OFFSET)

    def count_start(self) -> int:
        """Master only: one more supervisor started; returns the count (1 for the first)."""
        starts = self.region.u64(L.STARTS_OFFSET) + 1
        self.region.set_u64(L.STARTS_OFFSET, starts)
        return starts

    # -- engine slots (shm.table) ----------------------------------------------------------------

    def engine_slot(self, name: str, url: str) -> int | None:
        """The engine slot of the engine ``name`` at ``url``; None if the master gave it none."""
        ident = identity(name, url)
        if ident not in self._engine_slots:
            self._engine_slots.update(self.table.mapping())  # one pass for every engine of the list
        return self._engine_slots.get(ident)

    def forget_slots(self) -> None:
        """A slot was retired at run time (discovery): look every identity up afresh."""
        self._engine_slots.clear()

    def assign_engines(self, engines: list[tuple[str, str]]) -> list[int]:
        """Master only, before it forks anything that will use them: a slot per (name, url), kept
        across reloads (``shm.table``; :class:`~narwhal.shm.table.TableFull` when one has none).
        The caller holds the table lock (:data:`~narwhal.shm.layout.TABLE_LOCK`)."""
        slots = self.table.assign([identity(n, u) for n, u in engines], self.oldest_worker_epoch())
        self._engine_slots.clear()  # what the master looked up before may have moved; forks inherit this
        return slots

    def oldest_worker_epoch(self) -> int | None:
        """The lowest table epoch a live worker noted (None: no worker): what a retired slot's
        reuse waits for (``shm.table``)."""
        epochs = [self.region.u32(self.layout.slot_offset(s) + L.SLOT_TABLE_EPOCH)
                  for s in self.claimed_slots() if _alive(self.slot_pid(s))]
        return min(epochs) if epochs else None

    def described(self) -> list[tuple[int, dict[str, Any], str]]:
        """Every LIVE engine slot whose descriptor is its engine's (``shm.descriptors``): slot,
        its ``[[engines]]`` entry, its source. A LIVE slot whose descriptor is missing or another
        identity's (being written) is left out: the caller reads again at the next epoch."""
        out = []
        for slot in range(self.layout.engines):
            entry = self.table.entry(slot)
            if entry.state != LIVE:
                continue
            found = descriptors.read(self.region, slot)
            if found is not None and identity(found[0]["name"], found[0]["url"]) == entry.identity:
                out.append((slot, found[0], found[1]))
        return out

    def live_slots(self) -> int:
        """How many table slots are LIVE: a worker following the table knows it read every descriptor."""
        return sum(1 for slot in range(self.layout.engines) if self.table.entry(slot).state == LIVE)

    # -- locks ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, *offsets: int) -> Iterator[None]:
        """Byte-range locks on the memfd, taken in increasing order (no deadlock)."""
        ordered = sorted(set(offsets))
        for off in ordered:
            fcntl.lockf(self.region.fd, fcntl.LOCK_EX, 1, off)
        try:
            yield
        finally:
            for off in reversed(ordered):
                fcntl.lockf(self.region.fd, fcntl.LOCK_UN, 1, off)

    @staticmethod
    def cap_lock(engine: int, phase: int) -> int:
        """The lock byte of an engine slot's cap in a phase: a capped reservation's check-and-increment."""
        return L.LOCK_BASE + engine * 2 + phase

    # -- slots ----------------------------------------------------------------------------------

    def slot_pid(self, slot: int) -> int:
        """The pid holding worker slot ``slot``; 0 when it is free."""
        return self.region.u32(self.layout.slot_offset(slot) + L.SLOT_PID)

    def claim_slot(self, pid: int) -> int | None:
        """Take a free slot for ``pid`` (a slot whose process is gone counts as free), the lowest."""
        with self.locked(L.CLAIM_LOCK):
            for slot in range(self.layout.slots):
                owner = self.slot_pid(slot)
                if owner == 0 or (owner != pid and not _alive(owner)):
                    self.clear_slot(slot, keep_ring=owner == 0)
                    self.region.set_u32(self.layout.slot_offset(slot) + L.SLOT_PID, pid)
                    if slot >= self.in_use():
                        self.region.set_u32(L.SLOTS_USED_OFFSET, slot + 1)
                    return slot
        return None

    def in_use(self) -> int:
        """One past the highest slot ever claimed: every scan of the slots stops there."""
        return min(self.region.u32(L.SLOTS_USED_OFFSET), self.layout.slots)

    def release(self, slot: int, pid: int) -> bool:
        """Free ``slot`` if ``pid`` (gone) still holds it, under the claim lock: a worker claiming
        the slot at that moment cannot be cleared by mistake, and the lock's syscalls order the
        clearing stores before the next claim on any memory model (``shm.records``)."""
        with self.locked(L.CLAIM_LOCK):
            if self.slot_pid(slot) != pid:
                return False
            self.clear_slot(slot)
        return True

    def clear_slot(self, slot: int, *, keep_ring: bool = False) -> None:
        """Release everything a (dead) worker held: its counts, and its pid (callers hold the
        claim lock: ``claim_slot``, :meth:`release`)."""
        base = self.layout.slot_offset(slot)
        start, size = self.layout.counts_offset(slot), self.layout.slot_counts_size
        self.mm[start : start + size] = bytes(size)
        for field in (L.SLOT_REQUESTS, L.SLOT_RETRIES, L.SLOT_MIGRATIONS, L.SLOT_TABLE_EPOCH):  # epoch 0: every slot
            self.region.set_u32(base + field, 0)
        self.region.set_u32(base + L.SLOT_CONNECTIONS, L.NOT_ACCEPTING)
        if not keep_ring:
            # Unread reports of a dead worker are dropped with it: the supervisor reads rings
            # every few milliseconds, so at most a handful of outcomes are lost.
            write = self.region.u64(base + L.SLOT_RING_WRITE)
            self.region.set_u64(base + L.SLOT_RING_READ, write)
        self.region.set_u32(base + L.SLOT_PID, 0)

    def claimed_slots(self) -> list[int]:
        """Worker slots held by some pid (alive or not: a dead one's is cleared by its reaper)."""
        return [s for s in range(self.in_use()) if self.slot_pid(s)]

    def live_workers(self) -> int:
        """Claimed slots whose worker is alive: the workers that read what the supervisor publishes."""
        return sum(1 for s in self.claimed_slots() if _alive(self.slot_pid(s)))

    # -- counts ---------------------------------------------------------------------------------

    def slot_counts(self, slot: int) -> tuple[int, ...]:
        """One worker slot's in-flight counts, index ``engine * 2 + phase`` (what tests read)."""
        return self._counts.unpack_from(self.mm, self.layout.counts_offset(slot))

    def set_count(self, slot: int, engine: int, phase: int, value: int) -> None:
        """Write one of a slot's in-flight counts; only that slot's worker may (tests stand in for one)."""
        self.region.set_u32(self.layout.count_offset(slot, engine, phase), value)

    def totals(self, engines: int | None = None) -> list[int]:
        """In-flight legs summed over every slot: index ``engine * 2 + phase``.

        ``engines`` limits the sum to the first engines (the configured fleet, usually far
        fewer than the layout's room): this runs on every placement, so it is one unpack of
        every slot's counts, with no pid check. An unclaimed slot holds zeros (``clear_slot``
        zeroes the counts before it frees the pid, and only the owner writes them), and a
        dead worker's slot counts until it is cleared, as it does for ``engine_total``.
        """
        n = self.layout.engines if engines is None else engines
        width = n * 2
        used = self.in_use()
        if not used:
            return [0] * width
        known = self._all_counts.get((n, used))
        if known is None:
            known = self._all_counts[(n, used)] = (_all_counts_struct(self.layout, n, used),
                                                  tuple(slice(i, None, width) for i in range(width)))
        fmt, columns = known
        values = fmt.unpack_from(self.mm, self._counts_base)
        # Each column (an engine's phase over the slots) summed by map, in C: no Python call per
        # column on a path every placement takes.
        return list(map(sum, map(values.__getitem__, columns)))

    def engine_total(self, engine: int, phase: int) -> int:
        """An engine slot's legs in flight in a phase, summed over claimed slots: the exact count a cap needs."""
        return sum(
            self.region.u32(self.layout.count_offset(slot, engine, phase))
            for slot in range(self.in_use())
            if self.slot_pid(slot)
        )

    def engine_seen(self, engine: int) -> int:
        """This host's legs on the engine that the engine itself can count: its prefills and its
        decodes less those reserved with a pair whose decode leg is not sent yet (the prefill
        still runs). What the load reader takes out of the engine's own report (docs/behaviour.md "Placement")."""
        u32, layout, seen = self.region.u32, self.layout, 0
        for slot in range(self.in_use()):  # one pass: each slot's owner looked at once, not thrice
            if self.slot_pid(slot):
                seen += (u32(layout.count_offset(slot, engine, 0)) + u32(layout.count_offset(slot, engine, 1))
                         - u32(layout.unsent_offset(slot, engine)))
        return max(seen, 0)

    def set_slot_field(self, slot: int, field: int, value: int) -> None:
        """Write a u32 of a slot's header; only that slot's worker may."""
        self.region.set_u32(self.layout.slot_offset(slot) + field, value)

    def slot_field_total(self, field: int) -> int:
        """A slot header u32 summed over claimed slots: the fleet-wide requests or retries in flight."""
        return sum(
            self.region.u32(self.layout.slot_offset(s) + field) for s in range(self.in_use()) if self.slot_pid(s)
        )

    def least_connections(self, excluding: int) -> int | None:
        """The fewest client connections of a worker other than slot ``excluding`` that is
        accepting (None when there is none): see ``narwhal.worker.accept``."""
        counts = [
            held
            for s in range(self.in_use())
            if s != excluding and self.slot_pid(s)
            and (held := self.region.u32(self.layout.slot_offset(s) + L.SLOT_CONNECTIONS)) != L.NOT_ACCEPTING
        ]
        return min(counts) if counts else None

    # -- outcome rings --------------------------------------------------------------------------

    def append(self, slot: int, report: Report) -> bool:
        """Worker side: add a report; False (and counted) when the ring is full."""
        layout = self.layout
        base = layout.slot_offset(slot)
        # Both indices in one read: they are adjacent u64s (write ours, read the supervisor's).
        write, read = L.RING_INDICES.unpack_from(self.mm, base + L.SLOT_RING_WRITE)
        if write - read >= layout.ring:
            dropped = self.region.u32(base + L.SLOT_DROPPED)
            self.region.set_u32(base + L.SLOT_DROPPED, dropped + 1)
            return False
        off = base + layout.ring_start + (write % layout.ring) * L.RING_ENTRY_SIZE  # ring_offset, from base
        self.mm[off : off + ENTRY_BYTES] = pack_report(report, write)
        self.region.set_u64(base + L.SLOT_RING_WRITE, write + 1)
        return True

    def drain(self, slot: int) -> list[Report]:
        """Supervisor side: every complete report since the last drain."""
        base = self.layout.slot_offset(slot)
        read = self.region.u64(base + L.SLOT_RING_READ)
        write = self.region.u64(base + L.SLOT_RING_WRITE)
        out: list[Report] = []
        while read < write:
            off = self.layout.ring_offset(slot, read)
            report = unpack_report(self.mm[off : off + ENTRY_BYTES], read)
            if report is None:
                break  # not fully visible yet: take it next time
            out.append(report)
            read += 1
        self.region.set_u64(base + L.SLOT_RING_READ, read)
        return out


def _all_counts_struct(layout: L.Layout, engines: int, slots: int) -> struct.Struct:
    """The first ``engines`` engines' counts of the first ``slots`` slots, in one struct (gaps skipped)."""
    width = engines * 2
    row = f"{width}I"
    gap = f"{layout.slot_size - width * 4}x"
    return struct.Struct("<" + (row + gap) * (slots - 1) + row)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by gunicorn) is as gone as a dead process.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Is ``pid`` running? A zombie (exited, not yet reaped) counts as gone."""
    return _alive(pid)
