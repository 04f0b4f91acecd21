"""Engine-reported load as placement weighs it: fresh readings only (docs/behaviour.md "Placement").

The supervisor publishes each engine's last ``/metrics`` reading with the time it was read;
this module turns those readings into what the choice needs, per engine index: the extra load
and whether the engine is saturated (fresh KV usage at or above ``placement.kv_saturated``).

The extra load is the reported running + waiting *less this host's own legs* counted in them
(``ours``, this host's in-flight legs on the engine when the reading arrived): placement adds
this host's legs exactly, from shared memory, so adding the engine's count of them again would
weigh this router's requests twice and another replica's once. With two consumers, one busy
with 16 requests from elsewhere and 8 of ours on the other, the double count calls them equal
and sends the next request into the busy one's queue; what is left — other replicas' and other
clients' requests — is what the engine's own figure adds to what this host knows. A
reading older than ``placement.load_stale_s`` counts as no reading at all: an engine whose
``/metrics`` hangs or lies is placed by this host's in-flight counts alone, as before.

Pure: the clock is an argument. :class:`LoadCache` keeps the last result until the
supervisor publishes a new round (a version number) or a reading in it goes stale, so a
placement costs one shared-memory word and a clock read, not one record per candidate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class LoadReading(Protocol):
    """What the supervisor published for one engine (``narwhal.shm.records.LoadRecord``)."""

    @property
    def read_at(self) -> float:
        """``time.monotonic()`` when read: older than ``load_stale_s`` means no reading."""

    @property
    def running(self) -> float:
        """Requests the engine said it was running, this host's legs included."""

    @property
    def waiting(self) -> float:
        """Requests the engine said were queued, this host's legs included."""

    @property
    def kv_usage(self) -> float | None:
        """KV cache fraction in use (None if not reported): at ``kv_saturated`` or above, saturated."""

    @property
    def ours(self) -> float:
        """This host's in-flight legs on the engine when the reading came: subtracted, counted exactly."""


class LoadSource(Protocol):
    """Where readings come from: shared memory in a worker."""

    def load_version(self) -> int:
        """The supervisor's publish round: unchanged means the readings are too. One word; cheap."""

    def load_readings(self) -> Sequence[LoadReading | None]:
        """Every engine's last reading by index (None: never read); a record each, so read on a new round only."""


@dataclass(frozen=True, slots=True)
class Loads:
    """Per engine index: fresh reported requests (0 without a fresh reading), saturation."""

    extra: list[float]
    saturated: list[bool]
    any_saturated: bool


def fresh_loads(
    readings: Sequence[LoadReading | None], now: float, stale_s: float, kv_saturated: float
) -> tuple[Loads, float]:
    """The loads to place by at ``now``, and until when they stay exactly these."""
    extra = [0.0] * len(readings)
    saturated = [False] * len(readings)
    valid_until = math.inf
    for i, reading in enumerate(readings):
        if reading is None or now - reading.read_at > stale_s:
            continue
        extra[i] = max(reading.running + reading.waiting - reading.ours, 0.0)
        usage = reading.kv_usage
        saturated[i] = usage is not None and usage >= kv_saturated
        valid_until = min(valid_until, reading.read_at + stale_s)
    return Loads(extra, saturated, any(saturated)), valid_until


class LoadCache:
    """The current :class:`Loads` of a source, recomputed only when they can have changed."""

    __slots__ = ("_source", "_clock", "_stale_s", "_kv_saturated", "_version", "_until", "_loads")

    def __init__(self, source: LoadSource, clock: Callable[[], float], stale_s: float, kv_saturated: float) -> None:
        self._source = source
        self._clock = clock
        self._stale_s = stale_s
        self._kv_saturated = kv_saturated
        self._version = -1
        self._until = -math.inf
        self._loads: Loads | None = None

    def current(self) -> Loads:
        """The loads to place by now; recomputed only on a new round or a reading going stale."""
        now = self._clock()
        version = self._source.load_version()
        if self._loads is None or version != self._version or now > self._until:
            self._loads, self._until = fresh_loads(self._source.load_readings(), now, self._stale_s, self._kv_saturated)
            self._version = version
        return self._loads
