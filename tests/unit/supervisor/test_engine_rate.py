"""The engine-reported prefill rate (``supervisor.holdings.engine_rate``, docs/behaviour.md "Placement"): differences
of the
engine's counters over spans of finished prefills, the best of the last spans, a restart's
counters starting again from 0."""

from __future__ import annotations

import pytest

from narwhal.supervisor.holdings.engine_rate import MIN_SAMPLES, SAMPLE_PREFILLS, WINDOW, EngineRate
from narwhal.supervisor.load_metrics import PrefillCounters


class Engine:
    """An engine's cumulative counters, advanced a span at a time."""

    def __init__(self) -> None:
        self.seconds = self.prefills = self.queried = self.hits = 0.0

    def span(self, prefills: float, uncached: float, seconds: float, hits: float = 0.0) -> PrefillCounters:
        self.prefills += prefills
        self.queried += uncached + hits
        self.hits += hits
        self.seconds += seconds
        return PrefillCounters(self.seconds, self.prefills, self.queried, self.hits)


def _learned(rate: EngineRate, engine: Engine, tokens_per_s: float, at: float = 0.0) -> float:
    """MIN_SAMPLES spans at ``tokens_per_s`` (one second of prefill each, reads a second apart)."""
    rate.observe(engine.span(0, 0, 0), at)
    for i in range(MIN_SAMPLES):
        rate.observe(engine.span(SAMPLE_PREFILLS, tokens_per_s, 1.0, hits=500), at + i + 1)
    return at + MIN_SAMPLES


def test_the_rate_is_uncached_tokens_per_second_of_prefill_once_enough_spans_were_seen() -> None:
    rate, engine = EngineRate(), Engine()
    assert rate.observe(engine.span(0, 0, 0), 0.0) is None  # a baseline, nothing measured
    for i in range(MIN_SAMPLES - 1):
        assert rate.observe(engine.span(SAMPLE_PREFILLS, 8000, 2.0, hits=10**5), 3.0 * (i + 1)) is None
    # Hits are not work: (queries − hits) ÷ prefill seconds.
    assert rate.observe(engine.span(SAMPLE_PREFILLS, 8000, 2.0, hits=10**5), 3.0 * MIN_SAMPLES) == 4000.0


def test_a_span_lasts_until_enough_prefills_finished_however_many_reads_it_takes() -> None:
    rate, engine = EngineRate(), Engine()
    at = _learned(rate, engine, 1000.0)
    for i in range(3):  # three reads of a third of a span each: one sample, at 3000 tokens/s
        rate.observe(engine.span(SAMPLE_PREFILLS / 3 + 1, 1000, 1 / 3), at + i + 1)
    assert rate.rate == pytest.approx(3000.0)


def test_overlapping_prefills_count_no_more_time_than_passed() -> None:
    rate, engine = EngineRate(), Engine()
    rate.observe(engine.span(0, 0, 0), 0.0)
    for i in range(MIN_SAMPLES):  # each span: 4 s of prefill time summed, in 1 s of the engine's time
        rate.observe(engine.span(SAMPLE_PREFILLS, 2000, 4.0), i + 1.0)
    assert rate.rate == 2000.0


def test_the_rate_is_the_best_of_the_last_window_of_spans() -> None:
    rate, engine = EngineRate(), Engine()
    at = _learned(rate, engine, 1000.0)
    rate.observe(engine.span(SAMPLE_PREFILLS, 500, 1.0), at + 1)  # a span under load reads low
    assert rate.rate == 1000.0
    for i in range(WINDOW):  # the fast spans leave the window: the rate follows the engine down
        rate.observe(engine.span(SAMPLE_PREFILLS, 400, 1.0), at + i + 2)
    assert rate.rate == 400.0


def test_a_restart_is_a_new_baseline_and_keeps_the_rate() -> None:
    rate, engine = EngineRate(), Engine()
    at = _learned(rate, engine, 1000.0)
    fresh = Engine()  # the new process's counters start from 0
    assert rate.observe(fresh.span(3, 60, 0.1), at + 1) == 1000.0
    # The span from the new baseline, not a negative difference from the old process's counters.
    assert rate.observe(fresh.span(SAMPLE_PREFILLS, 5000, 1.0), at + 2) == 5000.0


def test_spans_that_computed_nothing_measure_nothing() -> None:
    rate, engine = EngineRate(), Engine()
    rate.observe(engine.span(0, 0, 0), 0.0)
    for i in range(2 * MIN_SAMPLES):
        rate.observe(engine.span(SAMPLE_PREFILLS, 0, 0.5, hits=100), i + 1.0)  # all hits
        rate.observe(engine.span(SAMPLE_PREFILLS, 100, 0.0), i + 1.5)  # no time at all
    assert rate.rate is None
