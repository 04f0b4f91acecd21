"""The engines a router knows and the decisions about them. Pure decisions: no I/O and no awaits
here (``tests/unit/test_layers.py`` checks). Its modules:

- ``roster.py``: the engines, their roles and the permitted pairs
- ``placement/``: choosing and reserving a pair, a producer policy per module behind one interface
- ``passthrough.py``: choosing and reserving one engine for a passthrough route
- ``compat.py``: the facts about vLLM releases: compatible pairs, who frees a refused decode
- ``endpoint_support.py``: per model and endpoint: P/D, one engine alone, or 501
- ``blame.py``: the breakers' vocabulary, shared with the workers: states, outcomes, charges
"""

from narwhal.fleet.roster import Engine, Fleet, FleetView, pair_permitted

__all__ = ["Engine", "Fleet", "FleetView", "pair_permitted"]
