"""The supervisor's part of placement policy ``held``: what each producer holds, learned and published.

- ``part.py``: ``HoldingsPart``, the policy's supervisor part (``supervisor.policy_part``): the
  workers' prefill rings merged, the region published, the engines' reads and states taken in
- ``model.py``: ``HoldingsModel``, what each producer is believed to hold, from its sources
- ``producer.py``: the record kept per producer, and what "hot" means for its keys
- ``lru.py``: the model's per-report LRU steps
- ``fit.py``: prefill duration against uncached characters, and the live prefixes
- ``rate.py``: the rates a producer is placed at, the same on every replica
- ``engine_rate.py``: an engine's own prefill rate, from its ``/metrics``
"""

from narwhal.supervisor.holdings.model import PUBLISH_S, HoldingsModel
from narwhal.supervisor.holdings.part import HoldingsPart
from narwhal.supervisor.holdings.producer import HOT_S, ProducerHoldings

__all__ = ["HOT_S", "PUBLISH_S", "HoldingsModel", "HoldingsPart", "ProducerHoldings"]
