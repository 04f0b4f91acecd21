"""The producer policies by the name ``placement.policy`` gives them (docs/behaviour.md "Placement").

A new policy is a module implementing :class:`~narwhal.fleet.placement.policy.Policy` and one line
here; ``placement.policy`` then accepts its name (``tests/unit/fleet/test_policies.py`` holds the
setting's choices and this table together).
"""

from __future__ import annotations

from collections.abc import Callable

from narwhal.fleet.placement.affinity import Affinity
from narwhal.fleet.placement.held import Held
from narwhal.fleet.placement.least_loaded import LeastLoaded
from narwhal.fleet.placement.policy import Policy

POLICIES: dict[str, Callable[[], Policy]] = {
    Held.name: Held,
    Affinity.name: Affinity,
    LeastLoaded.name: LeastLoaded,
}


def policy_named(name: str) -> Policy:
    """A new instance of the policy called ``name`` (the settings allow only these names)."""
    return POLICIES[name]()
