"""One prefill's outcome, the handoff a decode may carry: what the producer answered, and when.

Split from ``engines.connector`` along its seam: the connector holds the NixlConnector rules
(the prefill rewrite, the release body, the descriptor's validation), which the endpoints'
dialects use; a result names the client's endpoint, which names its dialect. With both in one
module the dialects, the endpoints and the connector imported each other.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from narwhal.engines.endpoints import Endpoint


@dataclass(slots=True)
class PrefillResult:
    """A finished prefill: the descriptor and what is needed to decode it.

    ``descriptor`` is None for a same-worker prefill. Pass the result unchanged to
    :meth:`narwhal.engines.client.EngineClient.decode`.
    """

    producer: str  # the producer engine's name
    producer_url: str
    endpoint: Endpoint  # the client's, resolved once: its path on both legs and its dialect
    request_id: str  # the backend X-Request-Id, the same on both legs of an attempt
    descriptor: dict[str, Any] | None
    crossed: bool = True  # False: same-worker decode, no descriptor asked for
    started_at: float = field(default_factory=time.monotonic)  # handoff age starts here
    finished_at: float = 0.0
    # The producer's prompt tokens and cached prompt tokens, from its endpoint's own usage fields
    # (``Dialect.prompt_usage``; None: absent).
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    def parameters(self) -> dict[str, Any] | None:
        """A detached deep copy of the descriptor: mutating it changes nothing here."""
        return copy.deepcopy(self.descriptor)

    def age(self, now: float | None = None) -> float:
        """Seconds since the prefill started: the handoff's age, refused over ``handoff.max_age_s``."""
        return (time.monotonic() if now is None else now) - self.started_at
