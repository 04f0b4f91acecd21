"""The request path's metric updates, added up in plain Python and written to prometheus_client in bulk.

The request path adds to :attr:`Tally.counts` itself (``TALLY.counts[child] += 1``: no call at
all, four per streamed request); :meth:`Tally.inc` is the same for everyone else.

Why: in multiprocess mode (every gunicorn worker's samples scraped together) one
``Counter.inc`` is about eleven interpreted calls — the observability check, a lock, a pid
check, a struct pack into the mmap file — and a ``Histogram.observe`` about eighteen. A streamed
request updates nine series (requests, attempts, placements, prefill tokens, four latency
histograms), an eighth of all the Python calls the worker spends on it. Here an update is a
dict addition (a histogram's also one ``bisect``), and :meth:`Tally.flush` writes what
accumulated, one ``inc`` per changed series, every :data:`FLUSH_S` from the worker's loop,
before every ``/metrics`` render, and when the worker stops. The totals are the same; a
scrape may see another worker's last :data:`FLUSH_S` of requests late, which no Prometheus
scrape interval can tell.

Invariants:

* Nothing is lost or counted twice: ``flush`` moves each pending amount into the series and
  zeroes it in one step, with no await in between (one thread per worker, the event loop's).
* A histogram sample lands in the bucket ``Histogram.observe`` would choose (the first upper
  bound ≥ the value: ``bisect_left``) and in the sum. The histogram's internals this needs
  (``_upper_bounds``, ``_buckets``, ``_sum``) are checked when it is registered; a
  prometheus_client without them gets plain ``observe`` calls: slower, never wrong.
* Failure-path metrics (engine faults, retries, aborts) are rare and stay direct.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import defaultdict
from typing import Any

from prometheus_client import Histogram

log = logging.getLogger("narwhal.metric_tally")

FLUSH_S = 0.25  # how stale a scrape may see another worker's counts


class _Pending:
    """One histogram's samples since the last flush: per-bucket counts and their sum."""

    __slots__ = ("hist", "bounds", "buckets", "total", "direct")

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist
        bounds = getattr(hist, "_upper_bounds", None)
        self.direct = not (isinstance(bounds, list) and hasattr(hist, "_buckets") and hasattr(hist, "_sum"))
        self.bounds: list[float] = [] if self.direct else list(bounds or ())
        self.buckets = [0] * len(self.bounds)
        self.total = 0.0


class Tally:
    """Pending counter amounts and histogram samples of this process."""

    __slots__ = ("counts", "_hists")

    def __init__(self) -> None:
        # A counter (or labelled child) -> amount since the flush; ``+=`` on a defaultdict is
        # no function call at all, so the request path adds to it directly
        # (``TALLY.counts[child] += 1``: read the attribute each time, ``flush`` replaces it).
        self.counts: defaultdict[Any, float] = defaultdict(float)
        self._hists: dict[Histogram, _Pending] = {}

    def histogram(self, hist: Histogram) -> _Pending:
        """Register ``hist`` (an unlabelled histogram); returns what :meth:`observe` takes."""
        pending = self._hists.get(hist)
        if pending is None:
            pending = self._hists[hist] = _Pending(hist)
        return pending

    def inc(self, counter: Any, amount: float = 1.0) -> None:
        """Add ``amount`` to ``counter`` at the next flush (the request path writes ``counts`` directly)."""
        self.counts[counter] += amount

    def observe(self, pending: _Pending, value: float) -> None:
        """A histogram sample into its pending bucket and sum (straight to ``observe`` without the internals)."""
        if pending.direct:
            pending.hist.observe(value)
            return
        pending.buckets[bisect.bisect_left(pending.bounds, value)] += 1
        pending.total += value

    def flush(self) -> None:
        """Write everything pending into prometheus_client's series."""
        counts, self.counts = self.counts, defaultdict(float)
        for counter, amount in counts.items():
            try:
                counter.inc(amount)
            except ValueError:  # a negative amount: one bad count is dropped, never the flush
                log.warning("a metric count of %r was not written: counters only go up", amount)
        for pending in self._hists.values():
            buckets = pending.buckets
            if not any(buckets):
                continue
            hist: Any = pending.hist
            for i, n in enumerate(buckets):
                if n:
                    hist._buckets[i].inc(n)
                    buckets[i] = 0
            hist._sum.inc(pending.total)
            pending.total = 0.0

    async def keep_flushing(self) -> None:
        """The worker's flush loop (cancelled at shutdown, after which :meth:`flush` runs once more)."""
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                self.flush()
            except Exception:  # the flush goes on: a scrape must never stop moving for good
                log.exception("the metric flush failed; the next one runs in %gs", FLUSH_S)
