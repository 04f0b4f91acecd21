"""The holdings model's LRU steps (``supervisor.holdings.lru``) against the per-key loops they
replace: the same model, driven by the same seeded random reports (prompts sharing system
prefixes, exact repeats, hits, evictions, trims to a small room, capacity changes, restarts,
ageing), must say the same at every step — each report's judgement, every producer's keys in
order with their first times, its hot keys in order with their times, its hot count."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest

from narwhal.shm.holdings import PrefillReport, section_stamp
from narwhal.supervisor.holdings import HOT_S, HoldingsModel, ProducerHoldings
from narwhal.supervisor.holdings import model as holdings_module
from narwhal.supervisor.holdings import producer as producer_module

STAMPS = [section_stamp("p0", "http://p0"), section_stamp("p1", "http://p1")]


def _leading(p: ProducerHoldings, keys: tuple[int, ...], started: float) -> int:
    n = 0
    for key in keys:
        at = p.keys.get(key)
        if at is None or at > started:
            break
        n += 1
    return n


def _touch(p: ProducerHoldings, keys: tuple[int, ...], at: float) -> None:
    for key in reversed(keys):
        if key in p.keys:
            p.keys.move_to_end(key)
        else:
            p.keys[key] = at


def _reused(p: ProducerHoldings, run: tuple[int, ...], at: float) -> None:
    for key in run:
        p.hot[key] = at
        p.hot.move_to_end(key)


def _hot_count(p: ProducerHoldings, stale: float) -> int:
    while p.hot:
        key, at = next(iter(p.hot.items()))
        if at >= stale:
            break
        del p.hot[key]
    return len(p.hot)


def _per_key_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model as it was: a Python step per key, no run or head kept."""
    for name, loop in (("leading", _leading), ("touch", _touch), ("reused", _reused), ("hot_count", _hot_count),
                       ("drop", lambda p: None)):
        for module in (holdings_module, producer_module):  # the model's steps, and the record's own
            if hasattr(module, name):
                monkeypatch.setattr(module, name, loop)


def _hot_as_reused(p: ProducerHoldings) -> list[tuple[int, float]]:
    """``hot`` with the time each key was really last reused at (the last run's, still unwritten)."""
    hot: OrderedDict[int, float] = OrderedDict(p.hot)
    if p.hot_stale:
        for key in p.hot_head:
            hot[key] = p.hot_head_at
    return list(hot.items())


def _trace(seed: int) -> list[Any]:
    rng = random.Random(seed)
    model = HoldingsModel(STAMPS, 24, 256)
    chains: dict[tuple[int, ...], int] = {}  # a prompt's blocks up to k -> block k's key (chained)
    systems = [[rng.randrange(1000) for _ in range(rng.randint(1, 8))] for _ in range(4)]
    last: list[int] = []
    at, out = 100.0, []
    for _ in range(400):
        roll = rng.random()
        if roll < 0.3 and last:
            blocks = last  # the same prompt again
        else:
            blocks = rng.choice(systems) + [rng.randrange(6) for _ in range(rng.randint(0, 3))]
        last = blocks
        keys = tuple(chains.setdefault(tuple(blocks[: k + 1]), len(chains) + 1) for k in range(len(blocks)))
        at += rng.choice((0.01, 0.2, 0.7, 1.5, 2.5, -0.3))
        producer = rng.randrange(2)
        chars = len(keys) * 256 + 40
        cached = rng.choice((None, 0, rng.randint(0, len(keys)) * 64, len(keys) * 64))
        rep = PrefillReport(producer, STAMPS[producer], rng.choice((11, 11, 11, 12)), chars, chars // 4, cached,
                            rng.choice((0.01, 0.3, 1.0)), keys, 0, at)
        out.append(model.apply(rep))
        if rng.random() < 0.05:
            model.set_capacity(producer, rng.choice((None, 40 * 256, 60 * 256)))
        if rng.random() < 0.02:
            model.forget(producer)
        for p in model.producers:
            assert p is not None
            if rng.random() < 0.3:
                out.append(p.hot_blocks(at + rng.choice((0.0, HOT_S / 2, HOT_S + 0.1))))
            out.append((list(p.keys.items()), _hot_as_reused(p)))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_the_kept_runs_change_nothing_the_model_says(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = _trace(seed)
    with monkeypatch.context() as m:
        _per_key_loops(m)
        loops = _trace(seed)
    assert kept == loops


def test_a_repeated_prefix_keeps_its_run_and_the_same_prompt_moves_nothing() -> None:
    model = HoldingsModel(STAMPS, 64, 256)
    shared = (1, 2, 3)

    def rep(keys: tuple[int, ...], cached: int, at: float) -> PrefillReport:
        return PrefillReport(0, STAMPS[0], 11, len(keys) * 256 + 40, (len(keys) * 256 + 40) // 4, cached, 0.01,
                             keys, 0, at)

    model.apply(rep((*shared, 4), 0, 10.0))
    model.apply(rep((*shared, 5), 3 * 64, 11.0))  # hit the shared three
    p = model.producers[0]
    assert p is not None and p.hot_head == shared and not p.hot_stale and p.head == (*shared, 5)
    model.apply(rep((*shared, 6), 3 * 64, 12.0))  # the same run again: only its time
    assert p.hot_head == shared and p.hot_stale and p.hot_head_at == 12.0
    assert list(p.hot.items()) == [(1, 11.0), (2, 11.0), (3, 11.0)]  # written when needed, not now
    assert p.hot_blocks(12.0 + HOT_S - 0.5) == 3  # 11.0 would have aged out: the run's own time counts
    assert p.hot_blocks(12.0 + HOT_S + 0.5) == 0 and p.hot_head == ()
    before = list(p.keys.items())
    model.apply(rep((*shared, 6), 4 * 64, 13.0))  # the very prompt touched last
    assert list(p.keys.items()) == before == [(4, 10.0), (5, 11.0), (6, 12.0), (3, 10.0), (2, 10.0), (1, 10.0)]
