"""Shared by the breaker tests: a permitted-pairs fleet, its breakers, outcomes and a state's read-outs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from narwhal.settings import RecoverySettings
from narwhal.supervisor.breaker import Breakers, EngineInfo, Outcome, State

# ------------------------------------------------------------------------------------ helpers


def mesh(
    producers: Iterable[str] = (),
    consumers: Iterable[str] = (),
    both: Iterable[str] = (),
    *,
    waves: dict[str, str] | None = None,
    only: dict[str, list[str]] | None = None,
) -> list[EngineInfo]:
    """A fleet where every producer may hand off to every consumer, unless ``only[name]`` narrows it."""
    roles = {**{n: "producer" for n in producers}, **{n: "consumer" for n in consumers}, **{n: "both" for n in both}}
    only = only or {}

    def permitted(p: str, d: str) -> bool:
        if roles[p] == "consumer" or roles[d] == "producer" or (p == d and roles[p] != "both"):
            return False
        return (p not in only or d in only[p]) and (d not in only or p in only[d])

    return [
        EngineInfo(
            name=name,
            role=role,
            wave=(waves or {}).get(name),
            permitted_consumers=frozenset(d for d in roles if permitted(name, d)),
            permitted_producers=frozenset(p for p in roles if permitted(p, name)),
        )
        for name, role in roles.items()
    ]


def breakers(infos: list[EngineInfo], has_contract: bool = False, **recovery: Any) -> Breakers:
    return Breakers(infos, RecoverySettings(**recovery), has_contract=has_contract)


def ok(p: str, d: str, at: float = 0.0) -> Outcome:
    return Outcome(p, d, True, None, None, None, True, False, at)


def prefill_fault(p: str, d: str, at: float = 0.0, reason: str = "engine_5xx") -> Outcome:
    return Outcome(p, d, False, p, "prefill", reason, True, True, at)


def decode_fault(
    p: str, d: str, at: float = 0.0, *, before: bool = True, reason: str = "first_token_timeout"
) -> Outcome:
    return Outcome(p, d, False, d, "decode", reason, True, before, at)


def state(b: Breakers, name: str) -> State:
    return b.status(name).state


def streak(b: Breakers, name: str) -> int:
    return b.status(name).failure_streak


def eject_by_faults(b: Breakers, name: str, at: float) -> None:
    for _ in range(3):
        b.health_failed(name, at, "health_check")
    assert state(b, name) is State.EJECTED
