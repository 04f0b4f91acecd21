"""A worker's view of the shared fleet state: admission, fleet-wide counts, outcome reports.

Per request this costs a generation check (one u64 read) and, for placement, one unpack of
every slot's counts at once: no lock and no IPC round-trip. The slot's own u32 stores (six per
request) are one item store each into the region's u32 word view (``layout.Region.words``:
one copy of the four bytes, no Python call, where ``store_u32`` was two). Engine records are decoded again
only when the supervisor bumps the generation, and until they carry that generation (on
aarch64 the bump can be seen first: ``shm.records``). A failure seen here quarantines its
engine in this worker at once; the fleet learns of it when the supervisor publishes.

Everything this worker reads or writes in shared memory for an engine — records, counts,
cap locks, reports — is at the engine's *slot* in the engine table (``shm.table``), looked up
once by name and URL: after a reload that changes the engine list, this worker (old or new)
and the supervisor still mean the same engine by it.

Out and quarantined are kept apart (see :class:`narwhal.fleet.roster.FleetView`): ejected, probing
and draining engines are not :meth:`~WorkerFleetState.placeable`; quarantined ones (published
or local) are, but not :meth:`~WorkerFleetState.admitted`, so placement takes them only when
nothing else can serve. Whether any is quarantined is known without a scan per placement (a
flag set once per generation when the records are decoded, and the local table's size), and
the normal path never asks it anyway: only a placement whose first pass found nothing does.
"""

from __future__ import annotations

import time

from narwhal.errors import EngineError
from narwhal.fleet import Engine, Fleet
from narwhal.shm import layout as L
from narwhal.shm.local import UNREACHABLE_HOLD_S, Quarantine
from narwhal.shm.records import (
    FLAG_BEFORE_TOKEN,
    FLAG_CONNECT,
    FLAG_COUNTS,
    FLAG_OK,
    FLAG_PREFILL,
    KIND_LOCAL_OUTCOME,
    KIND_OUTCOME,
    NONE16,
    REASON_CODE,
    RECORD_BY_OPERATOR,
    RECORD_UNREACHABLE,
    EngineRecord,
    LoadRecord,
    RecordBusy,
    Report,
    read_load,
    read_record,
)
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import LIVE, record_hash, worker_epoch

ADMITTED_STATES = frozenset({0, 5})  # admitted, degraded
QUARANTINED = 1
_OUT_WORDS = {2: "ejected", 3: "probing", 4: "draining"}  # the out states, as /ready and a 503 name them
BREAKER_OUT_STATES = frozenset({2, 3})  # ejected, probing: the breaker's (draining is the operator's)
PLACEABLE_STATES = ADMITTED_STATES | {QUARANTINED}  # quarantine is soft (docs/behaviour.md "Recovery"); 2-4 are out
_PHASE = {"prefill": 0, "decode": 1}


class UnmappedEngine(Exception):
    """An engine of this worker's list has no engine slot in the shared table (``shm.table``)."""


class WorkerFleetState:
    """Engines are ``fleet.engines[i]`` here and their engine slot ``_slots[i]`` in shared
    memory (``shm.table``): every list this class returns is by fleet index."""

    def __init__(self, shared: SharedFleet, slot: int, fleet: Fleet, *, by_slot: bool = False) -> None:
        self.shared = shared
        self.slot = slot
        self.fleet = fleet
        if by_slot:  # a fleet that changes at run time: each engine's index is its engine slot
            self._slots = list(range(shared.layout.engines))
            self._span = fleet.span
        else:
            found = [shared.engine_slot(e.name, e.url) for e in fleet.engines]
            missing = [e.name for e, s in zip(fleet.engines, found, strict=True) if s is None]
            if missing:
                raise UnmappedEngine(", ".join(missing))
            self._slots = [s for s in found if s is not None]
            self._span = max(self._slots, default=-1) + 1  # totals() reads the counts of slots below it
        size = len(self._slots)
        self._prefill_at = [2 * s for s in self._slots]
        self._decode_at = [2 * s + 1 for s in self._slots]
        self._in_order = self._slots == list(range(len(self._slots)))  # the usual case: slices
        self._mine = [0] * (size * 2)
        self._joining: set[int] = set()  # engines taken up at run time whose record is not read yet
        self._generation = -1
        self._records: list[EngineRecord | None] = [None] * size
        self._published_avoided = False  # some record of this generation is QUARANTINED or unreachable
        self._loads: list[LoadRecord | None] = [None] * size
        self._load_seen = 0  # the load generation load_version last saw
        self._load_behind = False  # the readings taken for it were older (see load_version)
        self._load_retry = -1
        self._hashes = [0] * size
        for e in fleet.engines:
            self._hashes[e.index] = record_hash(e.name, e.url)
        self._quarantine = Quarantine()  # local, at once
        self._unreachable = Quarantine()  # engines this worker just failed to connect to (shm.local)
        self._requests = 0
        self._bounded = {L.SLOT_RETRIES: 0, L.SLOT_MIGRATIONS: 0}  # this worker's retries and migrated streams
        # This slot's fields at fixed offsets, written several times per request: one
        # store_u32 each (never pack_into, which zeroes the field first: shm.layout), not a
        # chain of offset helpers (see SharedFleet for the layout).
        self._mm = shared.mm
        # The per-request stores go through the region's u32 word view: ``words[i] = value`` is
        # one copy of the four bytes and no call (``layout.Region.words``); so the offsets
        # below are word indexes (byte offset // 4; every u32 field is aligned).
        self._words = shared.region.words()
        self._count_at = [shared.layout.count_offset(slot, s, p) // 4 for s in self._slots for p in (0, 1)]
        self._unsent = [0] * size
        self._unsent_at = [shared.layout.unsent_offset(slot, s) // 4 for s in self._slots]
        self._requests_at = (shared.layout.slot_offset(slot) + L.SLOT_REQUESTS) // 4
        self._connections_at = shared.layout.slot_offset(slot) + L.SLOT_CONNECTIONS
        # Which table epoch this worker's engine slots belong to: no slot it uses is given to
        # another engine while it lives (shm.table).
        L.store_u32(self._mm, shared.layout.slot_offset(slot) + L.SLOT_TABLE_EPOCH,
                    worker_epoch(shared.table, [self._slots[e.index] for e in fleet.engines]))

    # -- a fleet that changes at run time (worker.roster_follow) -----------------------------------

    def follow(self, added: list[Engine], removed: list[Engine]) -> None:
        """The fleet (``by_slot``) was rebuilt: new engines wait for their first record (never
        placed before the supervisor said PROBING or better), removed ones lose what this
        worker remembered of them; the records are read again."""
        for e in removed:
            self._records[e.index] = self._loads[e.index] = None
            self._quarantine.pop(e.index, None)
            self._unreachable.pop(e.index, None)
        for e in added:
            self._records[e.index] = self._loads[e.index] = None
            self._hashes[e.index] = record_hash(e.name, e.url)
            self._joining.add(e.index)
        self._span = self.fleet.span
        self._generation = -1

    def holds(self, engine_slot: int) -> bool:
        """Has this worker a leg in flight, or a decode not sent yet, on that engine slot?"""
        return bool(self._mine[2 * engine_slot] or self._mine[2 * engine_slot + 1] or self._unsent[engine_slot])

    def note_epoch(self, epoch: int) -> None:
        """Note in this slot the table epoch it holds nothing older than (``shm.table``: a retired slot waits)."""
        L.store_u32(self._mm, self.shared.layout.slot_offset(self.slot) + L.SLOT_TABLE_EPOCH, epoch)

    # -- FleetView ------------------------------------------------------------------------------

    def records(self) -> list[EngineRecord | None]:
        """Each engine's breaker record by fleet index (None: none yet, or not this engine's); decoded per bump."""
        generation: int = L.U64.unpack_from(self._mm, L.GENERATION_OFFSET)[0]
        if generation != self._generation:
            fresh = list(self._records)
            complete = True
            for engine in self.fleet.engines:
                at = self._slots[engine.index]
                try:
                    rec = read_record(self.shared.region, at)
                except RecordBusy:
                    complete = False  # mid-write: keep what we had, read again next time
                    continue
                behind = rec is None or rec.version < generation
                if generation and behind and self.shared.table.entry(at).state == LIVE:
                    complete = False  # the bump was seen before this record's publish (shm.records);
                    # a retired engine's record (a reload removed it) is published no more
                if rec is not None and rec.name_hash != self._hashes[engine.index]:
                    rec = None  # a record written for another engine list (before a reload) is not ours
                elif rec is not None:
                    self._joining.discard(engine.index)
                fresh[engine.index] = rec
            self._records = fresh
            self._published_avoided = any(
                r is not None and (r.state == QUARANTINED or r.flags & RECORD_UNREACHABLE) for r in fresh)
            if complete:
                self._generation = generation
        return self._records

    def admitted(self, engine: Engine) -> bool:
        """Neither out nor quarantined (``FleetView``); a joining engine is neither until its first record."""
        rec = self.records()[engine.index]
        if rec is None:
            if engine.index in self._joining:
                return False
        elif rec.state not in ADMITTED_STATES or rec.flags & RECORD_UNREACHABLE:
            return False
        if self._unreachable and self._unreachable.holds(engine.index):
            return False
        return not (self._quarantine and self._quarantine.holds(engine.index))

    def placeable(self, engine: Engine) -> bool:
        """Not out (``FleetView``): quarantined engines are placeable, as the last resort."""
        rec = self.records()[engine.index]
        if rec is None:
            return engine.index not in self._joining  # a discovered engine: not before the supervisor spoke
        return rec.state in PLACEABLE_STATES

    def any_avoided(self) -> bool:
        """Might some engine be quarantined or unreachable, published or local (``FleetView``)?
        A stale True costs a second pass."""
        # Local entries are dropped lazily (admitted() deletes expired ones): a stale entry
        # here only costs placement a second pass that finds what the first did.
        self.records()
        return self._published_avoided or bool(self._quarantine) or bool(self._unreachable)

    def unreachable(self, engine: Engine) -> bool:
        """Published unreachable, or this worker failed to connect a moment ago (``FleetView``)."""
        rec = self.records()[engine.index]
        if rec is not None and rec.flags & RECORD_UNREACHABLE:
            return True
        return bool(self._unreachable) and self._unreachable.holds(engine.index)

    def ejected_by_breaker(self, engine: Engine) -> bool:
        """Ejected or probing by its breaker, not by an operator (``FleetView``)."""
        rec = self.records()[engine.index]
        return rec is not None and rec.state in BREAKER_OUT_STATES and not rec.flags & RECORD_BY_OPERATOR

    def why_out(self, engine: Engine) -> str:
        """Why it is out, as the supervisor published it (``FleetView``)."""
        rec = self.records()[engine.index]
        if rec is None:
            return "joining"
        if rec.flags & RECORD_BY_OPERATOR:
            return "ejected by the operator"
        return _OUT_WORDS.get(rec.state, "out of service")

    def mark_unreachable(self, engine: Engine) -> None:
        """A connection to ``engine`` failed in this worker: avoided at once, until the
        supervisor's word replaces this one (``shm.local.UNREACHABLE_HOLD_S``)."""
        self._unreachable.add(engine.index, UNREACHABLE_HOLD_S)

    def quarantine_left(self, engine: Engine) -> float:
        """Seconds left of the later of this worker's and the published quarantine (``FleetView``)."""
        left = self._quarantine.left(engine.index)
        rec = self.records()[engine.index]
        if rec is not None and rec.state == QUARANTINED and rec.quarantined_until is not None:
            left = max(left, rec.quarantined_until - time.time())  # published in Unix seconds
        return max(left, 0.0)

    def quarantine(self, engine: Engine, seconds: float) -> None:
        """Quarantine ``engine`` in this worker at once, before the supervisor hears of the failure."""
        self._quarantine.add(engine.index, seconds)

    # -- LoadSource (narwhal.fleet.placement.load) -----------------------------------------------

    def load_version(self) -> int:
        """Bumped by the supervisor after each round of ``/metrics`` readings: one u64. While the
        readings taken for it do not show that round yet (``shm.records``: the bump can be seen
        before the record), a new value each time, so placement reads them again."""
        version: int = L.U64.unpack_from(self._mm, L.LOAD_GENERATION_OFFSET)[0]
        self._load_seen = version
        if self._load_behind:
            self._load_retry -= 1
            return self._load_retry
        return version

    def load_readings(self) -> list[LoadRecord | None]:
        """Every engine's last reading (None: never read, or read for another engine list)."""
        out: list[LoadRecord | None] = [None] * len(self._slots)  # by Engine.index
        newest = 0
        behind = False
        for engine in self.fleet.engines:
            i = engine.index
            try:
                rec = read_load(self.shared.region, self._slots[i])
            except RecordBusy:
                behind = True
                out[i] = self._loads[i]
                continue
            newest = max(newest, 0 if rec is None else rec.version)
            out[i] = rec if rec is not None and rec.name_hash == self._hashes[i] else None
        self._load_behind = behind or newest < self._load_seen
        self._loads = out
        return out

    # -- InflightCounts -------------------------------------------------------------------------

    def totals(self, phase: str) -> list[int]:
        """Fleet-wide legs in flight per engine in one phase (``InflightCounts``), one unpack."""
        both = self.shared.totals(self._span)
        if self._in_order:
            return both[_PHASE[phase]::2]
        return [both[i] for i in (self._prefill_at if phase == "prefill" else self._decode_at)]

    def both_totals(self) -> tuple[list[int], list[int]]:
        """Fleet-wide (prefill, decode) legs per engine from one read of every slot (``InflightCounts``)."""
        both = self.shared.totals(self._span)
        if self._in_order:
            return both[0::2], both[1::2]
        return [both[i] for i in self._prefill_at], [both[i] for i in self._decode_at]

    def count(self, engine: Engine, phase: str) -> int:
        """Fleet-wide legs on one engine in a phase (``InflightCounts``), summed slot by slot."""
        return self.shared.engine_total(self._slots[engine.index], _PHASE[phase])

    def try_reserve(self, engine: Engine, phase: str, cap: int | None) -> bool:
        """Count a leg on ``engine``; with a cap, under the engine's cap lock and False when it is full."""
        p = _PHASE[phase]
        if cap is None:  # the usual case: no lock
            self._bump(engine.index, p, 1)
            return True
        at = self._slots[engine.index]  # the engine's slot: old and new workers of a reload share its lock
        with self.shared.locked(SharedFleet.cap_lock(at, p)):
            if self.shared.engine_total(at, p) >= cap:
                return False
            self._bump(engine.index, p, 1)
        return True

    def release(self, engine: Engine, phase: str) -> None:
        """Give back a leg :meth:`try_reserve` counted; :class:`Reservation` calls it exactly once."""
        self._bump(engine.index, _PHASE[phase], -1)

    # The stores below write one u32 word of the region's word view (one copy of the four
    # bytes, no call): they run six times per request; ``store_u32`` was two calls each.

    def unsent_decode(self, engine: Engine, delta: int) -> None:
        """Move this slot's reserved-but-unsent decodes on ``engine``, which the load reader subtracts."""
        i = engine.index
        self._unsent[i] = value = self._unsent[i] + delta
        at = self._unsent_at[i]
        self._words[at] = value

    def _bump(self, engine: int, phase: int, delta: int) -> None:
        i = engine * 2 + phase
        self._mine[i] = value = self._mine[i] + delta
        at = self._count_at[i]
        self._words[at] = value

    # -- requests and retries in flight (the fleet-wide retry budget) -----------------------

    def request_started(self) -> None:
        """One more request in flight in this worker: the retry budget's base."""
        self._requests += 1
        at = self._requests_at
        self._words[at] = self._requests

    def request_finished(self) -> None:
        """Pairs with :meth:`request_started`, once per request however it ends."""
        self._requests -= 1
        at = self._requests_at
        self._words[at] = self._requests

    def try_start_retry(self, ratio: float, minimum: int) -> bool:
        """Mark a request retrying if the fleet-wide budget allows (``ratio`` of requests, at least ``minimum``)."""
        return self._start(L.SLOT_RETRIES, ratio, minimum)

    def retry_finished(self) -> None:
        """The request :meth:`try_start_retry` marked has ended: its share of the budget is free."""
        self._finish(L.SLOT_RETRIES)

    def try_start_migration(self, ratio: float, minimum: int) -> bool:
        """Mark a stream migrating if the fleet-wide bound allows (``ratio`` of requests, at least
        ``minimum``): its own count, not the retry budget's (docs/decisions.md "Migration")."""
        return self._start(L.SLOT_MIGRATIONS, ratio, minimum)

    def migration_finished(self) -> None:
        """The stream :meth:`try_start_migration` marked has ended: its share of the bound is free."""
        self._finish(L.SLOT_MIGRATIONS)

    def _start(self, field: int, ratio: float, minimum: int) -> bool:
        """One more of ``field``'s count (a slot header u32) if the fleet's total stays below
        ``ratio`` of the requests in flight, or ``minimum``."""
        inflight = self.shared.slot_field_total(L.SLOT_REQUESTS)
        if self.shared.slot_field_total(field) >= max(minimum, int(ratio * inflight)):
            return False
        mine = self._bounded[field] = self._bounded[field] + 1
        self.shared.set_slot_field(self.slot, field, mine)
        return True

    def _finish(self, field: int) -> None:
        mine = self._bounded[field] = self._bounded[field] - 1
        self.shared.set_slot_field(self.slot, field, mine)

    # -- client connections (narwhal.worker.accept.ConnectionShare) ----------------------------------

    def publish(self, connections: int | None) -> None:
        """This worker's client connections for the others' accept pacing; None: not accepting."""
        L.store_u32(self._mm, self._connections_at, L.NOT_ACCEPTING if connections is None else connections)

    def least_other(self) -> int | None:
        """The fewest connections of another accepting worker (None: none), for accept pacing."""
        return self.shared.least_connections(excluding=self.slot)

    # -- outcome reports ------------------------------------------------------------------------

    def report(
        self, producer: Engine, consumer: Engine, *, error: EngineError | None = None,
        failed: Engine | None = None, before_first_token: bool = False, local: bool = False,
    ) -> None:
        """One attempt into this slot's ring (``narwhal.request.outcomes.Reporter``): a success
        without ``error``; a failure's phase, reason and weight as ring flags and codes; a
        local decode's under its own kind."""
        if error is None:
            flags, reason = FLAG_OK, 0
            if self._unreachable:  # a connection worked: this worker's mark is void
                self._unreachable.pop(producer.index, None)
                self._unreachable.pop(consumer.index, None)
        else:
            flags = (FLAG_COUNTS if error.counts else 0) | (FLAG_BEFORE_TOKEN if before_first_token else 0)
            flags |= FLAG_PREFILL if error.phase == "prefill" else 0
            flags |= FLAG_CONNECT if error.connect_failed else 0
            reason = REASON_CODE.get(error.reason, 0)
        self.shared.append(
            self.slot,
            Report(
                seq=0,
                at=time.monotonic(),
                producer=self._slots[producer.index],
                consumer=self._slots[consumer.index],
                failed=NONE16 if failed is None else self._slots[failed.index],
                reason=reason,
                flags=flags,
                kind=KIND_LOCAL_OUTCOME if local else KIND_OUTCOME,
            ),
        )

    def command(self, kind: int, engine: Engine) -> None:
        """An operator action for the supervisor to apply (admin API)."""
        self.shared.append(
            self.slot,
            Report(seq=0, at=time.monotonic(), producer=self._slots[engine.index],
                   consumer=self._slots[engine.index], failed=NONE16,
                   reason=0, flags=0, kind=kind),
        )
