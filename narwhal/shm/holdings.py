"""Prefix holdings in shared memory (docs/behaviour.md "Placement"): what each producer is believed to hold.

A memfd of its own, created by the gunicorn master beside the fleet region and inherited the
same way (no name, nothing left after ``kill -9``); kept apart from the fleet layout so the two
change independently. ::

    header                 64 B  magic, sizes, generation (bumped after each publish)
    sections    E × (80 B + (K + T) × 8 B)   per engine index, written only by the supervisor:
        seq u64 (odd while written), identity u32 (CRC32 of name and URL), count u32,
        capacity_blocks u32, crc u32, engine id u64, prefill chars/s f64, chars/token f64,
        mean uncached chars per prefill f64, hot blocks u32 (reused in the last few seconds),
        homes u32, token keys u32, tokens per block u32, flags u32 (``REPORT_FULL``), 0 u32;
        then ``count`` block keys, most recent first, then ``homes`` pairs of (first block key,
        blocks) u64: the live prefixes whose home this producer is; then, in a room of its own
        (T = ``token_keys``), the token block keys its KV-cache events say it holds
        (``fleet.placement.token_blocks``), most recent first
    rings       W × (16 B + R × entry)  per worker slot, written only by that worker:
        write index u64 (worker), read index u64 (supervisor); each entry one completed
        prefill: producer, its identity and engine id, prompt chars and tokens, cached
        tokens, duration, the queued work it was placed behind, and the prompt's block keys
        (at most M)
    work        W × E × u32   per worker slot and engine, written only by that worker: the
        uncached characters of its prefill legs in flight there (docs/behaviour.md "Placement"'s queued work)

Invariants, and why:

* One writer per field. A section is published under a sequence number (odd while it is
  written, a seqlock) *and* a CRC32 of its payload: a reader that sees an odd or changed
  sequence, or a wrong checksum, reads again and after a few tries keeps what it had. No lock
  on either side; a worker never waits for the supervisor.
* A reader ignores a section whose identity is not the engine it places: a section written for
  another engine list (before a reload) says nothing about this one.
* A ring entry carries its sequence number inside its CRC, as the outcome rings do, so a stale
  entry of an earlier lap cannot pass for a new one. A full ring drops the report (the
  holdings learn a little later from the next one); the worker never blocks.
* Reading costs one u64 per placement while nothing changed (and one unpack of the work
  counters of the slots in use, ``column_sums``); a section is decoded again only when its own sequence moved, into a
  ``frozenset`` the choice tests membership in. The supervisor publishes a section at most every
  0.1 s (``supervisor.holdings``), so a worker decodes at most that often per producer.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from narwhal.fleet.placement.policy import PolicyRegion
from narwhal.settings import Settings
from narwhal.shm.layout import RING_INDICES, U32, U64, Mapped, store_u32, whole_pages

MAGIC = 0x4E484C44  # "NHLD"
HEADER = struct.Struct("<IIIIIIII")  # magic, version, sections, keys per section, slots, ring, keys per entry,
#                                      token keys per section
HEADER_SIZE = 64
GENERATION_OFFSET = 32
SECTION_HEAD = 80
_SECTION = struct.Struct("<IIIIQdddIIIIII")  # identity, count, capacity, crc, engine id, rate, cpt, mean, hot,
#                                               homes, token keys, tokens per block, flags, 0 (at 8)
REPORT_FULL = 1  # section flag: its prefills ask for the full report of reused blocks (a late joiner)
RING_HEAD = 16
_ENTRY = struct.Struct("<QHHIIIIdQId")  # seq, producer, nkeys, identity, chars, tokens, cached, duration,
#                                          engine id, queued chars, finished at (monotonic)
ENTRY_HEAD = 64  # _ENTRY (56 B) + crc u32, padded to 8
_ENTRY_PAD = ENTRY_HEAD - _ENTRY.size - 4
NONE32 = 0xFFFFFFFF
_TRIES = 16


class Torn:
    """A section still being written after every try (:data:`TORN`, its one value)."""


TORN = Torn()


def section_stamp(name: str, url: str) -> int:
    """The stamp of an engine's section: its name and URL, the same in every process."""
    return zlib.crc32(f"{name}\0{url}".encode())


def engine_id_hash(engine_id: str | None) -> int:
    """A 64-bit stamp of an engine id, never 0 (0: none known)."""
    if not engine_id:
        return 0
    digest = hashlib.blake2b(engine_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


@dataclass(frozen=True)
class HoldingsLayout:
    """Where each part of the holdings region lies: a section per producer, a report ring per
    worker slot, a queued-work counter per (slot, producer); the same in every process."""

    sections: int  # engines (by index) with a section
    keys: int  # block keys per section
    slots: int  # worker slots (the fleet region's slot numbers)
    ring: int = 256
    entry_keys: int = 256  # block keys per report: max_prefix_chars // block_chars
    token_keys: int = 0  # token block keys per section (the engine's KV-cache events; 0: not followed)

    @cached_property  # read several times per request (report, work): computed once
    def section_size(self) -> int:
        """Bytes of one producer's section: its head, room for ``keys`` block keys and for
        ``token_keys`` token block keys."""
        return SECTION_HEAD + (self.keys + self.token_keys) * 8

    def section_offset(self, engine: int) -> int:
        """Where producer ``engine``'s section starts."""
        return HEADER_SIZE + engine * self.section_size

    @cached_property
    def entry_size(self) -> int:
        """Bytes of one prefill report in a ring."""
        return ENTRY_HEAD + self.entry_keys * 8

    def ring_offset(self, slot: int) -> int:
        """Where worker slot ``slot``'s report ring (its indices, then its entries) starts."""
        return HEADER_SIZE + self.sections * self.section_size + slot * (RING_HEAD + self.ring * self.entry_size)

    def entry_offset(self, ring: int, index: int) -> int:
        """Where report number ``index`` lies in the ring starting at ``ring`` (a
        :meth:`ring_offset`, which the caller has already: the ring wraps)."""
        return ring + RING_HEAD + (index % self.ring) * self.entry_size

    def work_offset(self, slot: int, engine: int) -> int:
        """Where ``slot``'s count of queued prefill characters on ``engine`` lies (one writer: that slot)."""
        return self.ring_offset(self.slots) + (slot * self.sections + engine) * 4

    @property
    def size(self) -> int:
        """The whole region's bytes, rounded up to whole pages."""
        return whole_pages(self.work_offset(self.slots, 0))


@dataclass(frozen=True, slots=True)
class Held:
    """One producer's published holdings, as a worker reads them."""

    keys: frozenset[int]
    blocks: int
    capacity_blocks: int | None
    chars_per_token: float | None
    prefill_chars_per_s: float | None
    mean_uncached_chars: float
    engine_id: int
    hot_blocks: int = 0  # of ``blocks``, those reused lately: live prefixes a new one would evict
    homes: dict[int, int] | None = None  # first block key -> blocks: the live prefixes homed here
    token_keys: frozenset[int] = frozenset()  # token block keys its KV-cache events say it holds
    block_tokens: int = 0  # tokens per block of ``token_keys``; 0: its events are not followed
    report_full: bool = False  # just subscribed: its prefills ask it to re-announce the blocks they reuse


class PrefillReport(NamedTuple):
    """A completed prefill, as a worker reports it (docs/behaviour.md "Placement", source 1 and 2). A named tuple,
    not a frozen dataclass: one is made per request on each side of the ring, and a frozen
    dataclass's ``__init__`` sets each of its ten fields through ``object.__setattr__``, several
    times the cost of a tuple (the supervisor decodes every worker's)."""

    producer: int
    identity: int
    engine_id: int
    prompt_chars: int
    prompt_tokens: int | None
    cached_tokens: int | None
    duration_s: float
    keys: tuple[int, ...]
    queued_chars: int = 0  # the queued prefill work the placement reckoned ahead of it
    at: float = 0.0  # when it finished (time.monotonic(), one clock for the host): the merge order


class Holdings(Mapped[HoldingsLayout]):
    """The mapped region: the supervisor publishes and drains, workers read and report."""

    NAME = "narwhal-holdings"  # its own memfd, inherited across fork as the fleet region is

    def write_header(self) -> None:
        """Magic, version 3 and the layout's sizes; a new region is zeroed otherwise."""
        layout = self.layout
        HEADER.pack_into(self.mm, 0, MAGIC, 3, layout.sections, layout.keys, layout.slots, layout.ring,
                         layout.entry_keys, layout.token_keys)

    def _u64(self, offset: int) -> int:
        value: int = U64.unpack_from(self.mm, offset)[0]
        return value

    def _set_u64(self, offset: int, value: int) -> None:
        self.mm[offset : offset + 8] = value.to_bytes(8, "little")

    @property
    def generation(self) -> int:
        """Moves with every publish: a reader that saw the same value has nothing new to read."""
        return self._u64(GENERATION_OFFSET)

    # -- sections (supervisor writes, workers read) ---------------------------------------------

    def publish(
        self, engine: int, stamp: int, engine_id: int, keys: list[int], capacity_blocks: int | None,
        prefill_chars_per_s: float | None, chars_per_token: float | None, mean_uncached_chars: float,
        hot_blocks: int = 0, homes: dict[int, int] | None = None, token_keys: Sequence[int] = (),
        block_tokens: int = 0, report_full: bool = False,
    ) -> None:
        """Supervisor side: one producer's holdings, most recent key first (cut to the room,
        the homes first); its token block keys (most recent first, cut to their room) with
        ``block_tokens`` > 0 when its KV-cache events are followed."""
        if engine >= self.layout.sections:
            return
        pairs = list(homes.items())[: self.layout.keys // 2] if homes else []
        keys = keys[: self.layout.keys - 2 * len(pairs)]
        off = self.layout.section_offset(engine)
        seq = self._u64(off)
        self._set_u64(off, seq | 1)  # odd: being written
        tokens = token_keys[: self.layout.token_keys] if block_tokens > 0 else ()
        body = struct.pack(f"<{len(keys) + 2 * len(pairs)}Q", *keys, *(v for pair in pairs for v in pair))
        token_body = struct.pack(f"<{len(tokens)}Q", *tokens)
        # A capacity the u32 cannot hold (an engine reporting 2^32 blocks or more)
        # is stored as the largest one it can: far beyond any section's room, so no bound at all.
        capacity = NONE32 if capacity_blocks is None else min(max(capacity_blocks, 0), NONE32 - 1)
        head = _SECTION.pack(stamp, len(keys), capacity, 0,
                             engine_id, prefill_chars_per_s or 0.0, chars_per_token or 0.0, mean_uncached_chars,
                             min(hot_blocks, len(keys)), len(pairs), len(tokens),
                             block_tokens if block_tokens > 0 else 0, REPORT_FULL if report_full else 0, 0)
        done = (seq | 1) + 1
        # The CRC covers the generation it is published under (as shm.records' do): on aarch64 a
        # reader may see the new even seq before the new body, and must not take the old body for it.
        crc = zlib.crc32(token_body, zlib.crc32(body, zlib.crc32(head, zlib.crc32(done.to_bytes(8, "little")))))
        self.mm[off + 8 : off + 8 + _SECTION.size] = head[:12] + crc.to_bytes(4, "little") + head[16:]
        self.mm[off + SECTION_HEAD : off + SECTION_HEAD + len(body)] = body
        at = off + SECTION_HEAD + self.layout.keys * 8  # the token keys' room
        self.mm[at : at + len(token_body)] = token_body
        self._set_u64(off, done)
        self._set_u64(GENERATION_OFFSET, self.generation + 1)

    def writes_seen(self) -> int:
        """How many section writes this reader sees completed, over every section: a publish
        writes one section (its sequence two higher) and then adds one to the generation, so
        once every publish is visible this equals the generation (``HoldingsReader.current``)."""
        layout, u64 = self.layout, self._u64
        return sum(u64(layout.section_offset(e)) >> 1 for e in range(layout.sections))

    def section_seq(self, engine: int) -> int:
        """``engine``'s section sequence (odd while being written); 0 for an engine without a section."""
        return self._u64(self.layout.section_offset(engine)) if engine < self.layout.sections else 0

    def read(self, engine: int, stamp: int) -> Held | None:
        """The producer's holdings if its section is published for ``stamp``; None otherwise
        (never written, another engine's, or still torn after a few tries)."""
        held = self.read_whole(engine, stamp)
        return None if isinstance(held, Torn) else held

    def read_whole(self, engine: int, stamp: int) -> Held | None | Torn:
        """As :meth:`read`, but :data:`TORN` when the section was being written at every try:
        a reader then keeps what it had and tries again, never taking "torn" for "holds nothing"."""
        if engine >= self.layout.sections:
            return None
        off = self.layout.section_offset(engine)
        mm = self.mm
        for _ in range(_TRIES):
            seq = self._u64(off)
            if seq == 0:
                return None
            if seq & 1:
                continue
            raw = mm[off + 8 : off + 8 + _SECTION.size]
            (ident, count, capacity, crc, engine_id, rate, cpt, mean, hot, nhomes, ntokens, bt, flags,
             _) = _SECTION.unpack(raw)
            if ident != stamp:
                return None
            count = min(count, self.layout.keys)
            nhomes = min(nhomes, (self.layout.keys - count) // 2)
            ntokens = min(ntokens, self.layout.token_keys)
            body = mm[off + SECTION_HEAD : off + SECTION_HEAD + (count + 2 * nhomes) * 8]
            at = off + SECTION_HEAD + self.layout.keys * 8
            token_body = mm[at : at + ntokens * 8]
            head = raw[:12] + b"\0\0\0\0" + raw[16:]
            under = zlib.crc32(seq.to_bytes(8, "little"))  # the generation this body must be for
            if self._u64(off) != seq or zlib.crc32(token_body, zlib.crc32(body, zlib.crc32(head, under))) != crc:
                continue
            values = struct.unpack(f"<{count + 2 * nhomes}Q", body)
            homes = dict(zip(values[count::2], values[count + 1 :: 2], strict=True)) if nhomes else None
            tokens = frozenset(struct.unpack(f"<{ntokens}Q", token_body)) if ntokens else frozenset()
            return Held(frozenset(values[:count]), count,
                        None if capacity == NONE32 else capacity, cpt or None, rate or None, mean, engine_id, hot,
                        homes, tokens, bt, bool(flags & REPORT_FULL))
        return TORN

    def read_keys(self, engine: int, stamp: int) -> list[int] | None:
        """The section's keys in their published order, most recent first (a restarted
        supervisor's starting state); None as for :meth:`read`."""
        if self.read(engine, stamp) is None:
            return None
        off = self.layout.section_offset(engine)
        count = min(int.from_bytes(self.mm[off + 12 : off + 16], "little"), self.layout.keys)
        return list(struct.unpack_from(f"<{count}Q", self.mm, off + SECTION_HEAD))

    # -- report rings (a worker writes its slot's, the supervisor drains) -------------------------

    def report(self, slot: int, rep: PrefillReport) -> bool:
        """Worker side: one completed prefill into its ring; False when the ring is full."""
        return self.write_report(slot, *rep)

    def write_report(
        self, slot: int, producer: int, ident: int, engine_id: int, chars: int, tokens: int | None,
        cached: int | None, duration_s: float, keys: Sequence[int], queued_chars: int = 0, at: float = 0.0,
    ) -> bool:
        """:meth:`report` from its fields (once per request): the entry packed in one call into the
        ring, no report tuple; the same bytes (``_ENTRY``, CRC at 56, keys at 64)."""
        layout = self.layout
        if slot >= layout.slots:
            return False
        mm = self.mm
        base = layout.ring_offset(slot)
        write, read = RING_INDICES.unpack_from(mm, base)  # both in one read: one call per report
        if write - read >= layout.ring:
            return False
        n = len(keys)
        if n > layout.entry_keys:
            keys, n = keys[: layout.entry_keys], layout.entry_keys
        queued_chars = 0 if queued_chars < 0 else queued_chars if queued_chars < NONE32 else NONE32 - 1
        off = layout.entry_offset(base, write)  # the layout's formula, the one drain reads by
        # pack_into zeroes the entry first: harmless, nothing reads it before the index moves
        struct.pack_into(f"<QHHIIIIdQIdI{_ENTRY_PAD}x{n}Q", mm, off, write, producer, n, ident, chars,
                         NONE32 if tokens is None else tokens, NONE32 if cached is None else cached, duration_s,
                         engine_id, queued_chars, at, 0, *keys)
        self.words()[(off + _ENTRY.size) >> 2] = zlib.crc32(  # entries start 8-aligned
            mm[off + ENTRY_HEAD : off + ENTRY_HEAD + 8 * n], zlib.crc32(mm[off : off + _ENTRY.size]))
        self._set_u64(base, write + 1)  # published last: the entry is whole
        return True

    def drain(self, slot: int) -> list[PrefillReport]:
        """Supervisor side: every complete report of the slot since the last drain."""
        layout = self.layout
        base = layout.ring_offset(slot)
        write, read = RING_INDICES.unpack_from(self.mm, base)
        out: list[PrefillReport] = []
        while read < write:
            rep = self._entry(layout.entry_offset(base, read), read)
            if rep is None:
                break  # not fully visible yet: next time
            out.append(rep)
            read += 1
        self._set_u64(base + 8, read)
        return out

    def skip(self, slot: int) -> None:
        """Supervisor side: a slot whose worker is gone: drop its unread reports and its prefill work."""
        base = self.layout.ring_offset(slot)
        self._set_u64(base + 8, self._u64(base))
        self.worker_gone(slot)

    def worker_gone(self, slot: int) -> None:
        """A slot whose worker is gone (it was their one writer): no prefill work queued by it is
        left counted on any producer. The master calls it as it frees the slot (``child_exit``),
        which it nearly always does before the supervisor's sweep."""
        if slot >= self.layout.slots:
            return
        for engine in range(self.layout.sections):
            store_u32(self.mm, self.layout.work_offset(slot, engine), 0)

    def _entry(self, off: int, index: int) -> PrefillReport | None:
        """Report number ``index``, at ``off``: None unless whole (its sequence and CRC agree)."""
        mm = self.mm
        head = mm[off : off + _ENTRY.size]
        seq, producer, nkeys, ident, chars, tokens, cached, duration, engine_id, queued, at = _ENTRY.unpack(head)
        if seq != index or nkeys > self.layout.entry_keys:
            return None
        body = mm[off + ENTRY_HEAD : off + ENTRY_HEAD + nkeys * 8]
        if zlib.crc32(body, zlib.crc32(head)) != U32.unpack_from(mm, off + _ENTRY.size)[0]:
            return None
        return PrefillReport(producer, ident, engine_id, chars, None if tokens == NONE32 else tokens,
                             None if cached == NONE32 else cached, duration, struct.unpack(f"<{nkeys}Q", body),
                             queued, at)


def create_region(need: PolicyRegion, settings: Settings, slots: int, engines: int | None = None) -> Holdings:
    """The holdings region policy ``held`` asks for (``PolicyRegion.create``), beside the fleet's:
    a section per engine slot (``engines``, default the configured engines), so a producer added
    by a reload or by discovery has one; the region's keys shared among the configured producers
    (each producer that joins later gets a section as large: pages are committed only as a
    section fills), and as much again for the engines' own blocks when their KV-cache events are
    followed."""
    producers = sum(1 for e in settings.engines if e.role != "consumer")
    keys = max(need.keys // max(producers, 1), 1)
    sections = max(engines if engines is not None else 0, len(settings.engines))
    token_keys = keys if settings.placement.kv_events else 0
    return Holdings.create(HoldingsLayout(sections=sections, keys=keys, slots=slots, entry_keys=need.entry_keys,
                                          token_keys=token_keys))
