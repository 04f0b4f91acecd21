"""A worker's view of the holdings region (``narwhal.shm.holdings``): what placement reads of
each producer's holdings, and the worker's own ring and work counters it writes.

Invariant: a worker reads sections only when their sequence moved (one u64 per placement while
nothing did), keeps what it had when a section is mid-write at every try (``TORN``), and writes
only its own slot's ring entries and work counters: it never waits for the supervisor and never
takes a lock. Why a module apart from the region's layout and operations: those are shared by
the master (creating it), the supervisor (publishing, draining) and workers; this is only the
worker's side, with its caches of what it decoded, and it changes with placement, not with the
layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal.fleet import Engine
from narwhal.shm.column_sums import ColumnSums
from narwhal.shm.holdings import GENERATION_OFFSET, NONE32, Held, Holdings, Torn, engine_id_hash, section_stamp
from narwhal.shm.layout import U64


def stamps_by_index(engines: Sequence[Engine]) -> list[int]:
    """Per engine index up to the highest of ``engines``, its stamp (by name and URL); 0 where no
    engine is (with discovery an index is a slot, and slots in use need not be contiguous)."""
    stamps = [0] * (max((e.index for e in engines), default=-1) + 1)
    for e in engines:
        stamps[e.index] = section_stamp(e.name, e.url)
    return stamps


class HoldingsReader:
    """A worker's view, decoded again only for sections whose sequence moved (one u64 per
    placement while nothing did). ``stamps[i]`` is the identity of engine index ``i``."""

    __slots__ = ("holdings", "stamps", "_generation", "_seqs", "_held")

    def __init__(self, holdings: Holdings, stamps: list[int]) -> None:
        self.holdings = holdings
        self.stamps = stamps
        self._generation = -1
        self._seqs = [-1] * len(stamps)
        self._held: list[Held | None] = [None] * len(stamps)

    def _restamp(self, stamps: list[int]) -> None:
        """The engines changed: an index whose stamp changed is read again, the rest kept."""
        old_stamps, old_seqs, old_held = self.stamps, self._seqs, self._held
        self.stamps = stamps
        self._seqs = [old_seqs[i] if i < len(old_stamps) and old_stamps[i] == s else -1 for i, s in enumerate(stamps)]
        self._held = [old_held[i] if i < len(old_stamps) and old_stamps[i] == s else None
                      for i, s in enumerate(stamps)]
        self._generation = -1  # read the sections whose sequence is unknown at the next placement

    def current(self) -> list[Held | None]:
        """Each producer's holdings as last published, re-read only when the generation moved.

        A generation is taken as seen only once the sections show every write it counts. Why:
        the supervisor writes a section (its sequence, two higher, after the body) and then adds
        one to the generation, but on aarch64 nothing orders those stores for another core
        (CPython emits no fences: ``shm.records``), so a worker may see the new generation
        before the section, read the old sequence, keep the old holdings — and, had it taken
        the generation as seen, keep them until the next publish. Each completed write adds one
        to its section's ``seq >> 1`` (a write under way, or one a dead supervisor left odd, adds
        nothing until its section is written whole), so the sum over every section counts the
        completed writes a reader sees (``Holdings.writes_seen``). Fewer than the generation: a
        write it counts is not visible yet, and the next placement reads again. At least as
        many: every write it counts is visible, or a later write is, whose own bump moves the
        generation again."""
        holdings = self.holdings
        generation = U64.unpack_from(holdings.mm, GENERATION_OFFSET)[0]  # Holdings.generation, one call not three
        if generation != self._generation:
            # Read first: a publish after this bumps it again. Not taken while a write it counts is unseen.
            self._generation = generation if holdings.writes_seen() >= generation else -1
            for i, stamp in enumerate(self.stamps):
                seq = holdings.section_seq(i)
                if seq != self._seqs[i]:
                    held = holdings.read_whole(i, stamp)
                    if isinstance(held, Torn):  # the writer was mid-section at every try: keep, look again
                        self._generation = -1
                        continue
                    self._held[i] = held
                    self._seqs[i] = seq
        return self._held


class WorkerHoldings(HoldingsReader):
    """A worker's side: the view placement reads, and its slot's ring it reports prefills to.
    ``report_prefill`` writes one entry and returns; nothing waits for the supervisor."""

    __slots__ = ("slot", "dropped", "_mine", "_work_at", "_all_work", "_n", "_id_hashes", "_words")

    def __init__(self, holdings: Holdings, stamps: list[int], slot: int) -> None:
        super().__init__(holdings, stamps)
        self.slot = slot
        self.dropped = 0
        self._words = holdings.words()  # a store is one copy, no call (twice per held placement)
        self._id_hashes: dict[str | None, int] = {}  # engine id -> its stamp: one per engine (life)
        self._shape([0] * len(stamps), [True] * len(stamps))  # a previous owner of the slot (dead) left its figures

    def _shape(self, mine: list[int], cleared: list[bool]) -> None:
        """Size the work counters to the stamps: ``mine`` kept per index, this slot's counter
        zeroed where ``cleared`` (a new engine there: what this slot counted was another's)."""
        layout = self.holdings.layout
        self._n = n = min(len(self.stamps), layout.sections)
        self._mine = (mine + [0] * n)[:n]
        self._work_at = [layout.work_offset(self.slot, e) >> 2 for e in range(n)]  # word indices (u32s, aligned)
        # Every slot's counters summed per engine, reading only up to the highest slot in use.
        self._all_work = ColumnSums(self.holdings.mm, layout.work_offset(0, 0), layout.slots, layout.sections, n)
        if self.slot < layout.slots:
            for e, at in enumerate(self._work_at):
                if e >= len(cleared) or cleared[e]:
                    self._mine[e] = 0
                    self._words[at] = 0

    def restamp(self, stamps: list[int]) -> None:
        """The worker's engines changed (discovery, ``worker.roster_follow``): sections and work
        counters follow the new indices; an index now another engine's starts from nothing."""
        old = self.stamps
        self._restamp(stamps)
        self._shape(self._mine, [i >= len(old) or old[i] != s for i, s in enumerate(stamps)])

    def roster(self, engines: Sequence[Engine]) -> None:
        """The worker's engines are now ``engines`` (discovery): its sections follow them."""
        self.restamp(stamps_by_index(engines))

    def add_work(self, engine: int, chars: int) -> None:
        """This worker's prefill legs in flight on ``engine`` gained (or, negative, lost)
        ``chars`` uncached characters: one store, no lock."""
        if engine < self._n and self.slot < self.holdings.layout.slots:
            value = self._mine[engine] + chars
            if value < 0:  # clamps written out, not max()/min(): twice per held placement
                value = 0
            self._mine[engine] = value
            self._words[self._work_at[engine]] = value if value < NONE32 else NONE32

    def work(self) -> list[int]:
        """Per engine index, the uncached characters of this host's prefill legs in flight."""
        sums = self._all_work.sums()
        return sums if self._n == len(self.stamps) else sums + [0] * (len(self.stamps) - self._n)

    def report_prefill(
        self, producer: int, engine_id: str | None, prompt_chars: int, prompt_tokens: int | None,
        cached_tokens: int | None, duration_s: float, keys: list[int], queued_chars: int = 0, at: float = 0.0,
    ) -> None:
        """Worker side: report one completed prefill to the supervisor (a full ring drops it, counted)."""
        if producer >= len(self.stamps):
            return
        stamp = self._id_hashes.get(engine_id)
        if stamp is None:  # a new engine (or a restart): hashed once, not once per prefill
            if len(self._id_hashes) >= 64:
                self._id_hashes.clear()
            stamp = self._id_hashes[engine_id] = engine_id_hash(engine_id)
        if not self.holdings.write_report(self.slot, producer, self.stamps[producer], stamp, prompt_chars,
                                          prompt_tokens, cached_tokens, duration_s, keys, int(queued_chars), at):
            self.dropped += 1


def worker_view(region: Holdings, engines: Sequence[Engine], slot: int) -> WorkerHoldings:
    """A worker's view of the holdings region (``PolicyRegion.worker``), for its ``slot``."""
    return WorkerHoldings(region, stamps_by_index(engines), slot)
