"""The supervisor's ring reads and report merge (``supervisor.reports``): a pass drains only the
rings written since the last; a repeated success skipped, and ticks and probes looked for only
from the earliest deadline on, leave the breakers exactly where applying everything leaves them
(seeded random sequences of reports, clock moves, probe verdicts and operator actions)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from narwhal.master.gunicorn_hooks import create_policy_region
from narwhal.settings import RecoverySettings, Settings
from narwhal.shm import layout as L
from narwhal.shm.holdings import PrefillReport
from narwhal.shm.records import (
    FLAG_BEFORE_TOKEN,
    FLAG_COUNTS,
    FLAG_OK,
    FLAG_PREFILL,
    KIND_DRAIN,
    KIND_EJECT,
    KIND_LOCAL_OUTCOME,
    KIND_OUTCOME,
    KIND_READMIT,
    NONE16,
    REASON_CODE,
    Report,
)
from narwhal.shm.shared import SharedFleet
from narwhal.supervisor.breaker import Breakers, State
from narwhal.supervisor.reports import RingIndexes, Successes, apply_reports
from tests.unit.supervisor.breaker_support import mesh

SEEDS = range(24)
STEPS = 400


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    region = SharedFleet.create(engines=8, slots=4)
    yield region
    region.close()


def _outcome_rings(shared: SharedFleet) -> RingIndexes:
    return RingIndexes(shared.layout.slot_offset(0) + L.SLOT_RING_WRITE, shared.layout.slot_size)


def test_only_the_rings_written_since_the_last_drain_are_named(shared: SharedFleet) -> None:
    for pid in (os.getpid(), 1, 1):
        shared.claim_slot(pid)
    rings = _outcome_rings(shared)
    assert rings.written(shared.mm, shared.in_use()) == []
    report = Report(0, 1.0, 0, 1, NONE16, 0, FLAG_OK, KIND_OUTCOME)
    assert shared.append(1, report) and shared.append(2, report) and shared.append(2, report)
    assert rings.written(shared.mm, shared.in_use()) == [1, 2]
    assert len(shared.drain(2)) == 2
    assert rings.written(shared.mm, shared.in_use()) == [1]
    assert len(shared.drain(1)) == 1
    assert rings.written(shared.mm, shared.in_use()) == []
    assert rings.written(shared.mm, 0) == []


def test_only_the_prefill_rings_written_since_the_last_drain_are_named() -> None:
    settings = Settings.model_validate({"engines": [{"name": "p", "url": "http://127.0.0.1:1", "role": "producer"},
                                                    {"name": "d", "url": "http://127.0.0.1:2", "role": "consumer"}]})
    holdings = create_policy_region(settings, 3)
    assert holdings is not None
    layout = holdings.layout
    rings = RingIndexes(layout.ring_offset(0), layout.ring_offset(1) - layout.ring_offset(0))
    assert rings.written(holdings.mm, 3) == []
    assert holdings.report(2, PrefillReport(0, 7, 0, 100, 25, 0, 0.01, (1, 2, 3)))
    assert rings.written(holdings.mm, 3) == [2]
    assert len(holdings.drain(2)) == 1
    assert rings.written(holdings.mm, 3) == []


@dataclass(frozen=True)
class Named:
    name: str


NAMES = ["p0", "p1", "d0", "d1", "b0"]
BY_SLOT = {slot: Named(name) for slot, name in enumerate(NAMES)}
SLOT = {name: slot for slot, name in enumerate(NAMES)}
PAIRS = [(p, d) for p in ("p0", "p1", "b0") for d in ("d0", "d1", "b0")]
COUNTED = [REASON_CODE[r] for r in ("engine_5xx", "first_token_timeout", "connect_error") if r in REASON_CODE]


def _breakers() -> Breakers:
    infos = mesh(["p0", "p1"], ["d0", "d1"], ["b0"], waves={"p0": "w", "d0": "w"})
    settings = RecoverySettings(eject_after=2, failure_quarantine_s=1.5, readmit_interval_s=2.0,
                                readmit_interval_max_s=8.0, max_ejected_fraction=0.7, wave_hold_s=5.0)
    return Breakers(infos, settings, has_contract=True)


def _report(rng: random.Random, at: float) -> Report:
    roll = rng.random()
    p, d = rng.choice(PAIRS)
    if roll < 0.04:
        return Report(0, at, SLOT[rng.choice(NAMES)], 0, NONE16, 0, 0,
                      rng.choice((KIND_EJECT, KIND_READMIT, KIND_DRAIN)))
    if roll < 0.8:  # successes, mostly repeats of a few pairs: what the skip is for
        kind = KIND_LOCAL_OUTCOME if (roll < 0.1 and p == "b0") else KIND_OUTCOME
        d = p if kind == KIND_LOCAL_OUTCOME else d
        return Report(0, at, SLOT[p], SLOT[d], NONE16, 0, FLAG_OK, kind)
    failed, flags = (p, FLAG_PREFILL) if rng.random() < 0.5 else (d, 0)
    flags |= FLAG_COUNTS if rng.random() < 0.9 else 0
    flags |= FLAG_BEFORE_TOKEN if rng.random() < 0.7 else 0
    return Report(0, at, SLOT[p], SLOT[d], SLOT[failed], rng.choice(COUNTED), flags, KIND_OUTCOME)


def _seen(b: Breakers) -> list[object]:
    return [(s, b.ejected_by_operator(s.name), b.waiting_for_wave(s.name)) for s in b.statuses()] + [b.version]


def _run(seed: int) -> tuple[set[State], int, int]:
    """One seeded sequence applied to breakers taking everything and to breakers skipping (the
    supervisor's way), compared after every step; the states visited, outcomes recorded and sent."""
    rng = random.Random(seed)
    everything, skipping, successes = _breakers(), _breakers(), Successes()
    recorded = 0
    real_record = skipping.record

    def record(outcome: Any) -> None:
        nonlocal recorded
        recorded += 1
        real_record(outcome)

    skipping.record = record  # type: ignore[method-assign]
    now, outcomes, visited = 0.0, 0, set()
    for _ in range(STEPS):
        roll = rng.random()
        if roll < 0.55:
            batch = [_report(rng, now + rng.random() * 0.01) for _ in range(rng.randint(1, 6))]
            outcomes += sum(1 for r in batch if r.kind in (KIND_OUTCOME, KIND_LOCAL_OUTCOME))
            apply_reports(batch, BY_SLOT, everything, now)  # type: ignore[arg-type]
            apply_reports(batch, BY_SLOT, skipping, now, successes)  # type: ignore[arg-type]
        elif roll < 0.9:
            now += rng.choice((0.005, 0.02, 0.3, 1.0, 2.5))
            everything._quiet_until = float("-inf")  # the reference looks at every engine every time
            everything.tick(now)
            skipping.tick(now)
            everything._quiet_until = float("-inf")
            plans = everything.due_probes(now)
            assert skipping.due_probes(now) == plans
            visited.update(s.state for s in everything.statuses())  # PROBING until the verdicts below
            for plan in plans:
                verdict = rng.choice(("pass", "pass", "fail", "inconclusive"))
                everything.probe_result(plan.engine, verdict, now)
                skipping.probe_result(plan.engine, verdict, now)
        else:
            name = rng.choice(NAMES)
            if everything.admitted(name, now):
                everything.health_failed(name, now, "health_check")
                skipping.health_failed(name, now, "health_check")
        assert _seen(skipping) == _seen(everything), f"seed {seed}"
        visited.update(s.state for s in everything.statuses())
    return visited, recorded, outcomes


def test_skipping_repeated_successes_and_idle_ticks_leaves_every_breaker_where_it_was() -> None:
    visited: set[State] = set()
    recorded = outcomes = 0
    for seed in SEEDS:
        states, applied, sent = _run(seed)
        visited |= states
        recorded, outcomes = recorded + applied, outcomes + sent
    assert visited == set(State)  # the sequences went through every state, not only ADMITTED
    assert recorded <= 0.9 * outcomes, (recorded, outcomes)  # and some successes were skipped as repeats
