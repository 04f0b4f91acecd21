"""Two small learners of the holdings model (``supervisor.holdings``), apart so it stays readable.

* :class:`Fit`: an exponentially weighted least-squares line through every unqueued prefill's
  (uncached characters, seconds). Its intercept is the fleet's fixed cost per prefill (the round
  trip, the router), which the learned rate must leave out: a producer that mostly hits would
  otherwise look slow, its prefills being mostly that fixed cost.
* :class:`Prefix`: a live prefix (by its first block key): its last use, its uses, its last hits,
  whose median is its size for homes (``fleet.placement.homes``).

Pure: time comes in as arguments.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FIT_ALPHA = 0.01  # the fleet's fixed cost per prefill: a slow mean over many prefills of every size


class Fit:
    """An exponentially weighted least-squares line through (uncached characters, seconds)."""

    __slots__ = ("mx", "my", "mxx", "mxy", "n")

    def __init__(self) -> None:
        self.mx = self.my = self.mxx = self.mxy = 0.0
        self.n = 0

    def add(self, x: float, y: float) -> None:
        """One prefill's uncached characters and duration."""
        a = 1.0 if self.n == 0 else max(FIT_ALPHA, 1.0 / (self.n + 1))
        self.mx += a * (x - self.mx)
        self.my += a * (y - self.my)
        self.mxx += a * (x * x - self.mxx)
        self.mxy += a * (x * y - self.mxy)
        self.n += 1

    def intercept(self, spread: float) -> float:
        """The seconds of a prefill of nothing (≥ 0); 0 until the samples' characters spread
        at least ``spread`` (a line through one point says nothing)."""
        var = self.mxx - self.mx * self.mx
        if var < spread * spread:
            return 0.0
        slope = (self.mxy - self.mx * self.my) / var
        if slope <= 0:
            return 0.0
        return max(self.my - slope * self.mx, 0.0)


@dataclass
class Prefix:
    """A live prefix: its last use, its uses, its last hits (in blocks), its blocks until one hits."""

    last: float
    blocks: int
    uses: int = 1
    hits: deque[int] = field(default_factory=lambda: deque(maxlen=9))

    def size(self) -> int:
        """Its blocks as homes count them: the median of its last hits, else its first prompt's."""
        if not self.hits:
            return self.blocks
        return sorted(self.hits)[len(self.hits) // 2]
