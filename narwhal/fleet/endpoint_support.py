"""How a model's engines can serve a P/D endpoint, given their vLLM releases (docs/behaviour.md,
"Endpoints per release"): disaggregated, on one engine alone, or not at all.

* ``PD``: some permitted, compatible producer and consumer can both hand off on the endpoint
  (or a ``both`` engine has the route: its same-worker decode needs no handoff);
* ``LOCAL``: permitted, compatible pairs exist but their release cannot hand off there, and a
  consumer has the route: the request is served without disaggregation (placement's local
  decode: one engine prefills and decodes). A model with no permitted pair at all is ``PD``:
  placement answers 503 ``no_engine`` with the incompatibility, as for any endpoint;
* ``NONE``: no engine serving the model has the route: 501 in the endpoint's error shape.

Why: 0.11 hands off only on chat and completions. A Responses prefill on 0.11 answers with no
handoff, which the request path must count against the producer; three such requests ejected a
healthy producer for all traffic. An engine is never charged for what its release cannot do.

Pure, no I/O; asked once per request, answered from a table rebuilt only when the fleet's
engines, models or versions change (``Fleet.version``).
"""

from __future__ import annotations

from narwhal.fleet import compat
from narwhal.fleet.roster import Engine, Fleet

PD, LOCAL, NONE = "pd", "local", "none"


class EndpointSupport:
    """:func:`decide` for a fleet, cached by ``(model, path)`` until the fleet changes."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._version = -1
        self._known: dict[tuple[str, str], str] = {}

    def of(self, model: str, path: str) -> str:
        """``PD``, ``LOCAL`` or ``NONE`` for a request for ``model`` on ``path``."""
        if self._version != self.fleet.version:
            self._known.clear()
            self._version = self.fleet.version
        key = (model, path)
        found = self._known.get(key)
        if found is None:
            found = self._known[key] = decide([e for e in self.fleet.engines if model in e.models], path)
        return found


def decide(serving: list[Engine], path: str) -> str:
    """The module's rule over the engines that serve the model."""
    if not serving:
        return PD  # nothing serves it: placement answers no_engine as for any endpoint
    paired = False  # some permitted, compatible pair exists, whatever the endpoint
    for p in serving:
        if not p.can_prefill:
            continue
        if p.role == "both":
            paired = True
            if compat.has_route(p.version, path):
                return PD
        for d in p.permitted_consumers:
            if d in serving and d is not p and compat.compatible(p, d):
                paired = True
                if compat.hands_off(p.version, path) and compat.hands_off(d.version, path):
                    return PD
    if not paired:
        # No permitted pair at all (connectors, roles, versions, transfer modes differ): never
        # a silent fallback onto consumers sized for decode; placement answers 503 no_engine.
        return PD
    if any(d.can_decode and compat.has_route(d.version, path) for d in serving):
        return LOCAL
    return NONE
