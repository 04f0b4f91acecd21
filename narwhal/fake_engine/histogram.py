"""A Prometheus histogram as vLLM's ``prometheus_client`` writes one: buckets, ``_count``, ``_sum``.

Why its own leaf: ``state`` (the bottom of the engine's stack) owns the engine's counters and
``routes`` writes them; both import this, and it imports nothing of the engine's.

vLLM's request-phase histograms (``vllm/v1/metrics/loggers.py``: ``vllm:request_queue_time_seconds``,
``vllm:request_prefill_time_seconds`` …) share ``REQUEST_LATENCY_BUCKETS``. Written as
``prometheus_client`` does: cumulative ``_bucket`` lines with ``le`` among the labels (sorted),
the ``+Inf`` bucket equal to ``_count``, then ``_sum``, then a ``_created`` gauge.

Invariant: ``count`` is the number of observations, ``total`` their sum, and each bucket counts
the observations at or under its bound (cumulative when written), so a reader can difference two
reads of ``_sum`` and ``_count`` exactly.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)


class Histogram:
    """Observations in buckets, with their count and sum."""

    __slots__ = ("bounds", "counts", "count", "total")

    def __init__(self, bounds: Sequence[float] = REQUEST_LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        """One observation (seconds): into the first bucket whose bound takes it."""
        at = bisect.bisect_left(self.bounds, value)
        if at < len(self.counts):
            self.counts[at] += 1
        self.count += 1
        self.total += value

    def lines(self, name: str, help_text: str, labels: str, created: float) -> list[str]:
        """Its exposition lines; ``labels`` the inner text of the label set (``engine="0",model_name="m"``,
        sorted), into which ``le`` goes in its sorted place after ``engine``."""
        head, _, tail = labels.partition(",")  # engine="0" | model_name=...
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{head},le="{float(bound)}",{tail}}} {float(running)}')
        out.append(f'{name}_bucket{{{head},le="+Inf",{tail}}} {float(self.count)}')
        out.append(f"{name}_count{{{labels}}} {float(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out += [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge",
                f"{name}_created{{{labels}}} {float(created)}"]
        return out
