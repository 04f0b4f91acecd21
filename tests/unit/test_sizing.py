"""``narwhal workers``' pure rules (narwhal.sizing): the counts it tries, the one it recommends,
and flags it refuses before starting anything."""

from __future__ import annotations

import argparse

import pytest

from narwhal.sizing import default_counts, main, recommend


def test_the_counts_double_up_to_twice_the_cores() -> None:
    assert default_counts(1) == [1, 2]
    assert default_counts(2) == [1, 2, 4]
    assert default_counts(3) == [1, 2, 4, 6]
    assert default_counts(8) == [1, 2, 4, 8, 16]


def test_the_smallest_count_within_five_percent_of_the_best_is_recommended() -> None:
    assert recommend({1: 500.0, 2: 980.0, 4: 1000.0, 8: 990.0}) == 2
    assert recommend({1: 500.0, 2: 900.0, 4: 1000.0}) == 4
    assert recommend({}) is None


@pytest.mark.parametrize(("counts", "seconds", "concurrency", "says"), [
    ("1,x", 1.0, 8, "--counts must be integers separated by commas, not '1,x'"),
    ("0,2", 1.0, 8, "must be positive"),
    ("1", 0.0, 8, "must be positive"),
    ("1", 1.0, 0, "must be positive"),
])
def test_bad_flags_are_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], counts: str, seconds: float, concurrency: int, says: str
) -> None:
    args = argparse.Namespace(counts=counts, seconds=seconds, concurrency=concurrency)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
