"""The placement policy's supervisor part: what the supervisor runs for a policy it does not know.

A policy that keeps shared memory (``PolicyRegion``, asked by the master before any fork) names
the part that writes it in the supervisor (``PolicyRegion.supervisor``); the supervisor builds
that part over the region and calls it from its loop through :class:`PolicyPart` alone; a
policy without a region has no part.

Invariants, and why:

* The supervisor names no policy: a new policy with a supervisor side is its part and the path
  its ``region`` gives, not a branch here or in the loop.
* A part decides from what it is handed (time comes in as an argument) and writes only its own
  region: the supervisor stays the one writer of the fleet's records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from narwhal.fleet import Engine
from narwhal.fleet.blame import State
from narwhal.fleet.placement.policy import part
from narwhal.fleet.placement.registry import region
from narwhal.settings import Settings


class PolicyPart(Protocol):
    """The supervisor's side of a policy with shared memory, called from the supervisor's loop."""

    # Each load read of an engine (index, KV capacity in tokens, prefill counters, time); None: not wanted.
    on_reading: Callable[..., None] | None

    def restore(self) -> None:
        """A (re)started supervisor takes over what the last one published."""

    def reshape(self, engines: Sequence[Engine]) -> None:
        """The fleet's engines are now ``engines`` (discovery)."""

    def states(self, engines: Sequence[Engine], state_of: Callable[[Engine], State]) -> None:
        """The breakers' states, as just published."""

    def forget(self, engine: Engine) -> None:
        """The engine's cache is not what was known: its own KV-cache events say so, or it answers
        again after refusing connections (maybe a new process)."""

    def drain(self, slots_in_use: int, now: float) -> None:
        """A pass: what the workers reported since the last, merged and published."""

    def worker_gone(self, slot: int) -> None:
        """The worker at ``slot`` died without a word."""


def policy_part(settings: Settings, policy_region: Any, engines: Sequence[Engine],
                followed: Callable[[], Mapping[int, Any]]) -> PolicyPart | None:
    """The configured policy's part over ``policy_region`` (the master's, ``shm.POLICY_REGION``);
    None when the policy keeps no shared memory. ``followed``: per engine index, its KV-cache
    event stream, as the supervisor follows them."""
    need = region(settings.placement)
    if need is None or policy_region is None:
        return None
    built: PolicyPart = part(need.supervisor)(policy_region, settings, engines, followed)
    return built
