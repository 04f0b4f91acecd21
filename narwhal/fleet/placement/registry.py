"""The producer policies by the name ``placement.policy`` gives them (docs/behaviour.md "Placement").

A new policy is a module implementing :class:`~narwhal.fleet.placement.policy.Policy` and one line
here; ``placement.policy`` then accepts its name (``tests/unit/fleet/test_policies.py`` holds the
setting's choices and this table together). Each is built from the placement settings and the
holdings (:class:`~narwhal.fleet.placement.holdings_source.HoldingsSource`: the worker's view of
the region its ``region`` asked for; None without one); the master asks :func:`region` what
shared memory the configured policy needs, knowing no policy.
"""

from __future__ import annotations

from narwhal.fleet.placement.affinity import Affinity
from narwhal.fleet.placement.held import Held
from narwhal.fleet.placement.holdings_source import HoldingsSource
from narwhal.fleet.placement.least_loaded import LeastLoaded
from narwhal.fleet.placement.policy import Policy, PolicyRegion
from narwhal.settings import PlacementSettings

POLICIES: dict[str, type[Held] | type[Affinity] | type[LeastLoaded]] = {
    Held.name: Held,
    Affinity.name: Affinity,
    LeastLoaded.name: LeastLoaded,
}


def build(settings: PlacementSettings, holdings: HoldingsSource | None = None) -> Policy:
    """The policy ``settings`` name (``placement.policy``: the settings allow only these names),
    built with what it owns."""
    return POLICIES[settings.placement_policy](settings, holdings)


def region(settings: PlacementSettings) -> PolicyRegion | None:
    """The shared memory the named policy needs (None: none)."""
    return POLICIES[settings.placement_policy].region(settings)
