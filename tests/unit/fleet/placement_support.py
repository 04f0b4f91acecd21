"""What the placement tests share: a fleet view, engine readings and a clock the test sets,
and a Placement built over them (docs/behaviour.md "Placement": every test decides exactly what placement sees)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from narwhal.fleet import Engine, Fleet
from narwhal.fleet.placement import LocalInflight, Placement, Reservation
from narwhal.fleet.placement.affinity import key_hash
from narwhal.settings import Settings

MODEL = "m"


class FakeView:
    """``out``: names out of placement; ``left``: name -> seconds of quarantine left;
    ``down``: names unreachable; ``ejected``: names out by their breaker (a subset of ``out``)."""

    def __init__(self) -> None:
        self.out: set[str] = set()
        self.left: dict[str, float] = {}
        self.down: set[str] = set()
        self.ejected: set[str] = set()
        self.calls: Counter[str] = Counter()

    def admitted(self, engine: Engine) -> bool:
        return engine.name not in self.out and engine.name not in self.left and engine.name not in self.down

    def unreachable(self, engine: Engine) -> bool:
        return engine.name in self.down

    def ejected_by_breaker(self, engine: Engine) -> bool:
        return engine.name in self.ejected

    def why_out(self, engine: Engine) -> str:
        return "ejected" if engine.name in self.ejected else "out of service"

    def placeable(self, engine: Engine) -> bool:
        self.calls["placeable"] += 1
        return engine.name not in self.out

    def any_avoided(self) -> bool:
        self.calls["any_avoided"] += 1
        return bool(self.left) or bool(self.down)

    def quarantine_left(self, engine: Engine) -> float:
        self.calls["quarantine_left"] += 1
        return self.left.get(engine.name, 0.0)


PRODUCERS = [f"p{i}" for i in range(4)]
KEY = key_hash("You are a helpful assistant. " * 8)


@dataclass
class Reading:
    read_at: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    ours: float = 0.0


class Readings:
    """A LoadSource: ``by_name`` readings; ``version`` bumped by the test when they change."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.by_name: dict[str, Reading] = {}
        self.version = 0
        self.reads = 0

    def set(self, **readings: Reading) -> None:
        self.by_name.update(readings)
        self.version += 1

    def load_version(self) -> int:
        return self.version

    def load_readings(self) -> list[Reading | None]:
        self.reads += 1
        return [self.by_name.get(e.name) for e in self.fleet.engines]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def build(
    engines: list[dict[str, Any]], seed: int = 0, compat: dict[str, Any] | None = None, **placement: Any
) -> tuple[Placement, Readings, Clock, LocalInflight, FakeView]:
    specs = [{"url": f"http://127.0.0.1:{9000 + i}", "models": [MODEL], **e} for i, e in enumerate(engines)]
    settings = Settings(engines=specs, placement=placement, compat=compat or {})
    fleet = Fleet(settings)
    view, inflight, readings, clock = FakeView(), LocalInflight(len(fleet.engines)), Readings(fleet), Clock()
    built = Placement(fleet, view, inflight, settings.placement, random.Random(seed), loads=readings, clock=clock)
    return built, readings, clock, inflight, view


def fleet_of(producers: int = 4, consumers: int = 2, **placement: Any) -> tuple[Placement, Readings, Clock,
                                                                             LocalInflight, FakeView]:
    engines = [{"name": f"p{i}", "role": "producer"} for i in range(producers)]
    engines += [{"name": f"d{i}", "role": "consumer"} for i in range(consumers)]
    return build(engines, **placement)


def place(placement: Placement, key: int | None = None, avoid: frozenset[str] = frozenset()) -> Reservation:
    found = placement.try_place(MODEL, avoid, key)
    assert found is not None
    return found


