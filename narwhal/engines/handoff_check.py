"""The handoff's own step before any decode leg (docs/behaviour.md "Handoff validation", and
the handoff's age).

Invariant: a decode leg carries a descriptor only as this step returned it (``CheckedHandoff``,
``engines.connector``): validated by the NixlConnector rules in order and younger than
``handoff.max_age_s``. Why a step of its own, before any leg is built: what an attempt does with
a refused handoff (count it abandoned, or release it) is the attempt's business, not the leg's,
and a probe's or preflight's decode (``engines.control_decode``) takes the same step.
"""

from __future__ import annotations

from narwhal.engines import failures
from narwhal.engines.connector import CheckedHandoff, validate_descriptor
from narwhal.engines.endpoints import Endpoint
from narwhal.engines.prefill_result import PrefillResult


def checked_handoff(
    result: PrefillResult, decode_endpoint: Endpoint, max_age_s: float | None
) -> CheckedHandoff | None:
    """docs/behaviour.md "Handoff validation", and the handoff's age: the descriptor a decode on
    ``decode_endpoint`` may
    carry (None when the prefill was not crossed: a same-worker or local decode carries none),
    or raise ``invalid_handoff`` (the NixlConnector rules in order) or ``handoff_expired``. Its
    own step, before any leg is built: what an attempt does with a refused handoff (count it
    abandoned, or release it) is the attempt's business, not the leg's. A same-worker decode has
    no handoff and no lease: no age limit but the request's deadline."""
    if not result.crossed:
        return None
    descriptor = validate_descriptor(
        result.descriptor, producer=result.producer, prefill_endpoint=result.endpoint.path,
        decode_endpoint=decode_endpoint.path,
    )
    if max_age_s is not None and result.age() > max_age_s:
        raise failures.expired(result, max_age_s)
    return descriptor
