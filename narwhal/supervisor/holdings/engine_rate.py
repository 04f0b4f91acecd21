"""A producer's prefill rate as the engine reports it (docs/behaviour.md "Placement"): the same for every router
replica.

Why: the rate the holdings learn (``supervisor.holdings``) comes from this replica's round trips,
so two replicas learn two rates, and homes scaled by them differ by replica (``fleet.placement.homes``
says what that costs). The engine's own ``/metrics`` say the same to every reader: uncached prompt
tokens per second of prefill = Δ(``vllm:prefix_cache_queries_total`` − ``…_hits_total``) ÷
Δ``vllm:request_prefill_time_seconds_sum`` between reads (``supervisor.load_metrics.parse_prefill``).

How: successive reads are differenced; a *sample* spans at least ``SAMPLE_PREFILLS`` finished
prefills (Δ``_count``), however many reads that takes, so a sample means the same span of work
whatever the read interval or the moment each replica reads at. The rate is the best of the
last ``WINDOW`` samples' rates: the reported rate only ever reads low (below), so the best
recent span is the nearest to the engine's speed, and a window of them changes slowly enough
that two replicas reading a few prefills apart agree.

What it measures: a request's prefill time runs from its scheduling to its first token, so a
prefill sharing the GPU's steps with others (or, in the fake, waiting on its prefill lane)
counts that time too: under load the rate reads low, the more so the busier the engine. That is
load as well as speed, which is why homes use it only in coarse classes relative to the
fastest (``homes.rate_class``).

Invariants, and why:

* Pure: counters come in as arguments, no clock.
* A counter that went down is an engine restart (vLLM's counters start from 0 in a new
  process): that read becomes the new baseline and the span in progress is dropped, the samples
  are kept (a restarted engine is usually on the same GPU; the window follows it if not).
* No rate until ``MIN_SAMPLES`` samples have been taken (``rate`` None): homes then fall back to
  unscaled room.
"""

from __future__ import annotations

from collections import deque

from narwhal.supervisor.load_metrics import PrefillCounters

SAMPLE_PREFILLS = 32  # finished prefills a sample spans at least
# The samples the rate is the best of: ~2,000 prefills. Shorter (16) let a fast producer whose
# recent spans were all busy fall below the class edge (``perf.scarce_sim``: classes flapped).
WINDOW = 64
MIN_SAMPLES = 4  # before as many, no rate: one span may be all waits


class EngineRate:
    """One producer's engine-reported prefill rate, from its successive counter reads."""

    __slots__ = ("_base", "_base_at", "_samples", "rate")

    def __init__(self) -> None:
        self._base: PrefillCounters | None = None  # the read the span in progress starts at
        self._base_at = 0.0  # and when it was read
        self._samples: deque[float] = deque(maxlen=WINDOW)  # the last samples' rates, oldest first
        self.rate: float | None = None  # uncached prompt tokens per second of prefill

    @property
    def counted(self) -> bool:
        """The engine's ``/metrics`` have carried its prefill counters (a rate is coming)."""
        return self._base is not None

    def observe(self, now: PrefillCounters, at: float) -> float | None:
        """One read of the engine's counters, made at ``at`` (monotonic seconds); the rate after
        it (None: not known yet)."""
        base, base_at = self._base, self._base_at
        if base is None or _went_down(base, now):
            self._base, self._base_at = now, at  # the first read, or a restart: counting starts here
            return self.rate
        if now.prefills - base.prefills < SAMPLE_PREFILLS:
            return self.rate  # the span goes on
        self._base, self._base_at = now, at
        # The engine computed during at most the span's prefill time and at most the span itself:
        # prefills that overlap (under load) add up to more than the time that passed.
        seconds = min(now.prefill_s - base.prefill_s, at - base_at)
        tokens = max((now.queried_tokens - now.hit_tokens) - (base.queried_tokens - base.hit_tokens), 0.0)
        if seconds <= 0 or tokens <= 0:
            return self.rate  # prefills that computed nothing measure nothing
        self._samples.append(tokens / seconds)
        if len(self._samples) >= MIN_SAMPLES:
            self.rate = max(self._samples)
        return self.rate


def _went_down(before: PrefillCounters, after: PrefillCounters) -> bool:
    """Any counter lower than before: the engine restarted."""
    return (after.prefill_s < before.prefill_s or after.prefills < before.prefills
            or after.queried_tokens < before.queried_tokens or after.hit_tokens < before.hit_tokens)
