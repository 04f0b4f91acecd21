"""The workers' rings read by the supervisor: only those written since, and their outcomes into the breakers.

Invariants, and why:

* A pass drains only the rings a worker wrote since the last one. Whether a ring has news is one
  look at every claimed slot's write and read index together (:class:`RingIndexes`: one
  ``unpack_from`` over the slots, however many there are), not a drain per slot: an idle pass,
  fifty a second, drained every slot's outcome ring and holdings ring for nothing.
  The look is only a hint: a write index read mid-store can at worst defer its ring to the next
  pass, 20 ms later, and the drain itself reads both indexes as ever (``SharedFleet.drain``).
* Reports reach the breakers in completion order, exactly as before (:func:`apply_reports`), but
  a success the breakers saw since they last changed is not built and applied again
  (:class:`Successes`): ``Breakers.changes`` moves with every change but time's, and between two
  moves a success already applied finds every streak it lowers already low and nothing pending
  to clear, so applying it again changes nothing. At c=1 nearly every report is that.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping, Sequence

from narwhal.fleet import Engine
from narwhal.reasons import Reason
from narwhal.shm.records import (
    FLAG_BEFORE_TOKEN,
    FLAG_CONNECT,
    FLAG_COUNTS,
    FLAG_OK,
    FLAG_PREFILL,
    KIND_DRAIN,
    KIND_EJECT,
    KIND_LOCAL_OUTCOME,
    KIND_OUTCOME,
    KIND_READMIT,
    NONE16,
    REASONS,
    Report,
)
from narwhal.supervisor.breaker import Breakers, Outcome
from narwhal.supervisor.reachability import Reachability


class RingIndexes:
    """Every slot's (write, read) index pair of one kind of ring, read in one ``unpack_from``:
    the pairs sit ``stride`` bytes apart from ``first`` on, the u64 write index, then the u64 read index."""

    def __init__(self, first: int, stride: int) -> None:
        self.first, self.stride = first, stride
        self._structs: dict[int, struct.Struct] = {}  # by slots in use, which rarely moves

    def written(self, buffer: mmap.mmap, slots: int) -> list[int]:
        """The slots among the first ``slots`` whose writer has written past what was read."""
        if slots <= 0:
            return []
        layout = self._structs.get(slots)
        if layout is None:
            gap = f"{self.stride - 16}x"
            layout = self._structs[slots] = struct.Struct("<" + ("QQ" + gap) * (slots - 1) + "QQ")
        pairs = layout.unpack_from(buffer, self.first)
        return [slot for slot in range(slots) if pairs[2 * slot] != pairs[2 * slot + 1]]


class Successes:
    """The successes (kind, producer slot, consumer slot) applied since ``Breakers.changes`` last moved."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int, int]] = set()
        self.changes = -1

    def repeated(self, breakers: Breakers, key: tuple[int, int, int]) -> bool:
        """Is this success one the breakers already took with nothing changed since (so a no-op)?"""
        if breakers.changes != self.changes:
            self.seen.clear()
            self.changes = breakers.changes
            return False
        return key in self.seen

    def applied(self, breakers: Breakers, key: tuple[int, int, int]) -> None:
        """The success went in: remembered, against the changes it left (it may have moved them)."""
        if breakers.changes != self.changes:
            self.seen.clear()
            self.changes = breakers.changes
        self.seen.add(key)


def apply_reports(reports: Sequence[Report], by_slot: Mapping[int, Engine], breakers: Breakers, now: float,
                  successes: Successes | None = None, reach: Reachability | None = None) -> None:
    """Reports (sorted here by completion time: "consecutive" is that order) into the breakers
    and, with ``reach``, what each says of reaching its engines (before any skip: a repeated
    success still says the engine answered); one naming an engine not in ``by_slot`` (a reload
    removed it) is dropped; with ``successes``, a repeated success is skipped (the module's text)."""
    for r in sorted(reports, key=lambda r: r.at):
        producer, consumer = by_slot.get(r.producer), by_slot.get(r.consumer)
        if producer is None or consumer is None:
            continue  # an engine a reload removed, reported by a worker still running on the old list
        if r.kind in (KIND_OUTCOME, KIND_LOCAL_OUTCOME):
            ok = bool(r.flags & FLAG_OK)
            key = (r.kind, r.producer, r.consumer)
            failed_engine = None if r.failed == NONE16 else by_slot.get(r.failed)
            failed = None if failed_engine is None else failed_engine.name
            reason = REASONS[r.reason] if r.reason < len(REASONS) else ""
            if reach is not None:
                reach.reported(producer.name, consumer.name, ok, failed, bool(r.flags & FLAG_CONNECT),
                               lost=reason == Reason.ENGINE_UNREACHABLE)
            if ok and successes is not None and successes.repeated(breakers, key):
                continue
            outcome = Outcome(
                producer=producer.name, consumer=consumer.name, ok=ok, failed_engine=failed,
                phase=None if failed is None else ("prefill" if r.flags & FLAG_PREFILL else "decode"),
                reason=reason or None, counts=bool(r.flags & FLAG_COUNTS),
                before_first_token=bool(r.flags & FLAG_BEFORE_TOKEN), at=r.at, local=r.kind == KIND_LOCAL_OUTCOME,
            )
            breakers.record(outcome)
            if ok and successes is not None:
                successes.applied(breakers, key)
        elif r.kind == KIND_EJECT:
            breakers.eject(producer.name, now)
        elif r.kind == KIND_READMIT:
            breakers.readmit(producer.name, now)
        elif r.kind == KIND_DRAIN:
            breakers.drain(producer.name, now)
