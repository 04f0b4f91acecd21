"""What the ``held`` policy's tests share: a holdings source the test sets, and a Placement with
policy ``held`` over it, the readings and the clock of :mod:`placement_support`."""

from __future__ import annotations

import random
from typing import Any

from narwhal.fleet import Fleet
from narwhal.fleet.placement import LocalInflight, Placement, Reservation
from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.fleet.placement.held import Held as HeldPolicy
from narwhal.settings import Settings
from narwhal.shm.holdings import Held
from tests.unit.fleet.placement_support import MODEL, Clock, FakeView, Readings

PRODUCERS = [f"p{i}" for i in range(4)]
PREFIX = "".join(f"system prompt block {i:03d} ".ljust(256, ".") for i in range(8))  # 8 blocks of 256


class FakeHoldings:
    """A HoldingsSource: per engine index what the supervisor would have published."""

    def __init__(self, engines: int) -> None:
        self.held: list[Held | None] = [None] * engines
        self.queued = [0] * engines  # this host's in-flight prefill work, in uncached characters
        self.reports: list[tuple[Any, ...]] = []  # the prefills the policy reported, as it reported them

    def set(self, index: int, keys: list[int], rate: float | None = None, mean: float = 0.0) -> None:
        self.held[index] = Held(frozenset(keys), len(keys), None, 4.0, rate, mean, 1)

    def current(self) -> list[Held | None]:
        return self.held

    def work(self) -> list[int]:
        return self.queued

    def add_work(self, engine: int, chars: int) -> None:
        self.queued[engine] += chars

    def report_prefill(self, producer: int, *report: Any) -> None:
        self.reports.append((producer, *report))


def build_held(seed: int = 0, consumers: int = 1,
               **placement: Any) -> tuple[Placement, FakeHoldings, Readings, Clock, LocalInflight]:
    engines = [{"name": n, "role": "producer"} for n in PRODUCERS]
    engines += [{"name": f"d{i}", "role": "consumer"} for i in range(consumers)]
    specs = [{"url": f"http://127.0.0.1:{9000 + i}", "models": [MODEL], **e} for i, e in enumerate(engines)]
    settings = Settings(engines=specs, placement={"policy": "held", **placement})
    fleet = Fleet(settings)
    holdings, readings, clock = FakeHoldings(len(fleet.engines)), Readings(fleet), Clock()
    inflight = LocalInflight(len(fleet.engines))
    built = Placement(fleet, FakeView(), inflight, settings.placement, random.Random(seed), loads=readings,
                      clock=clock, policy=HeldPolicy(settings.placement, holdings))
    return built, holdings, readings, clock, inflight


def prompt_blocks(text: str = PREFIX + "the user's question") -> PrefixBlocks:
    return PrefixBlocks(text, 256, 65536)


def place_blocks(placement: Placement, blocks: PrefixBlocks) -> Reservation:
    found = placement.try_place(MODEL, frozenset(), blocks, False)
    assert found is not None
    return found


def ranked(blocks: PrefixBlocks) -> list[str]:
    return rank(list(PRODUCERS), blocks.key(0), key_hash)
