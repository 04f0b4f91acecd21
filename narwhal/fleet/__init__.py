"""The engines a router knows and the decisions about them: the roster and permitted pairs,
placement and reservations, breakers and blame. Pure decisions: no I/O here.

Its modules: pure decisions, no I/O and no awaits (``tests/unit/test_layers.py`` checks):
``roster.py`` (engines, permitted pairs), ``placement/`` (choose and reserve a pair, a policy per
module behind one interface: ``policy.py`` what a producer policy is (it owns its data:
``prepare(prompt)`` keeps its note of a request, which the request path carries unread;
``order(candidates, asked)`` with each one's label; the hooks ``placed``, ``prefilled``,
``released`` on the reservation, whose ``note`` is the policy's; ``describe(engine)`` for the admin
API; ``region(settings)`` the shared memory it asks the master for) and saturation set aside once
for all, ``registry.py`` the policies by ``placement.policy`` name, each built with what it owns (a
new policy: its module and one line there), ``pair.py`` the passes (reserve now or say no; it asks
the policy and never names one), ``least_loaded.py`` (policy ``least_loaded``, and every consumer's
order), ``affinity.py`` bounded-load rendezvous hashing (policy ``affinity``), ``fallback.py`` the
second look when the first found no pair (quarantined, then ejected-but-reachable only in a role's
panic; reachable before unreachable whatever the load, saturation or breaker state, the one order of
every fallback), ``holdings_source.py`` (the holdings' interface the ``held`` policy reads and
reports its prefills through, ``HeldReading``, ``HoldingsSource``), ``held.py`` the least estimated
time to handoff knowing what each producer holds (policy ``held``, docs/behaviour.md "Placement",
the default), ``homes.py`` the live prefixes' homes, the same in every replica (bounded-room
rendezvous, rooms scaled by the engine-reported rate's class; the supervisor computes them,
placement reckons a home as holding its prefix), ``blocks.py`` the prompt's chained prefix block
keys (a worker's bounded memo of the keys it computed, so a repeated system prompt is not hashed
again), ``load.py`` fresh engine readings, ``reservation.py`` the slots), ``passthrough.py`` (choose
and reserve one engine for a passthrough route), ``compat.py`` (the facts about vLLM releases:
compatible pairs by version and transfer mode (``[compat] enforce_versions``), who frees a refused
decode (release, endpoint, validation 400), which endpoints a release hands off on or serves, 0.11's
TP rule), ``endpoint_support.py`` (per model and endpoint, from the engines' versions: P/D, one
engine alone, or 501), ``reachability.py`` (whose last connection attempt failed, from reports and
control reads), ``blame.py`` (the breakers' vocabulary, shared with the workers: states, outcomes,
who a failure counts against)
"""

from narwhal.fleet.roster import Engine, Fleet, FleetView, pair_permitted

__all__ = ["Engine", "Fleet", "FleetView", "pair_permitted"]
