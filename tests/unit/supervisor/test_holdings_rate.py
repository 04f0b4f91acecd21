"""The rate the estimate places each producer by (``supervisor.holdings.rate``): the fleet's
learned rate at each producer's engine-reported class, so replicas that learned different rates
still rank producers alike."""

from __future__ import annotations

import pytest

from narwhal.supervisor.holdings.rate import placing_rates

CPT = [4.0] * 4
ALL = [True] * 4  # every engine's /metrics carry the prefill counters
NONE = [False] * 4


def test_producers_are_placed_at_the_learned_mean_times_their_class() -> None:
    # Four producers, p3 reported at half the fastest's rate; the learned rates are one replica's noise.
    reported = [1000.0, 980.0, 1010.0, 470.0]
    rates = placing_rates([74_000.0, 200_000.0, 108_000.0, 16_000.0], reported, ALL, CPT)
    scale = (74_000 + 200_000 + 108_000 + 16_000 / 0.5) / 4  # each learned rate taken back to class 1
    assert rates == pytest.approx([scale, scale, scale, scale / 2])


def test_two_replicas_that_learned_different_rates_rank_the_producers_alike() -> None:
    reported = [1000.0, 980.0, 1010.0, 470.0]
    one = placing_rates([74_000.0, 200_000.0, 108_000.0, 32_000.0], reported, ALL, CPT)
    two = placing_rates([248_000.0, 70_000.0, 195_000.0, 25_000.0], [990.0, 1000.0, 1005.0, 520.0], ALL, CPT)
    assert [r / one[0] for r in one] == [r / two[0] for r in two] == [1.0, 1.0, 1.0, 0.5]  # type: ignore[operator]


def test_before_its_engine_gives_a_rate_a_counted_producer_is_in_class_1() -> None:
    # The first reads carry the counters but no rate yet: every replica ranks the four alike.
    assert placing_rates([74_000.0, 200_000.0, 108_000.0, 32_000.0], [None] * 4, ALL, CPT) == [103_500.0] * 4


def test_without_the_engines_counters_each_is_placed_by_its_own_learned_rate() -> None:
    learned = [100.0, None, 300.0, 50.0]
    assert placing_rates(learned, [None] * 4, NONE, CPT) == learned
    # One engine reports but nothing is learned yet: that one at its engine's rate in characters.
    assert placing_rates([None] * 4, [None, 900.0, None, None], [False, True, False, False], CPT) == [
        None, 3600.0, None, None]
    # Engines without counters beside ones with: their own learned rates (no class to place them by).
    counted = [True, True, False, False]
    assert placing_rates([100.0, 200.0, 60.0, None], [1000.0, 1000.0, None, None], counted, CPT) == [
        150.0, 150.0, 60.0, None]
