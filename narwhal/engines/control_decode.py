"""A probe's or preflight's decode, under the request path's handoff rules (docs/behaviour.md,
"Recovery" and "The lease").

Readmission probes (the supervisor) and preflight (the master) hand off real KV: a tiny prefill
on a producer, then a decode on a consumer. Their handoffs follow the rules a request's do:

- decoded only below ``handoff.max_age_s`` (a slow probe prefill decoded after the producer's
  lease would read blocks given to another request), and the decode's connect and send bounded
  by the handoff's remaining age (``DecodeLeg``);
- a handoff its consumer never received (the connect failed after ``/health`` passed, or the age
  ran out first) is released to another consumer that can take it in time, else counted
  abandoned; a descriptor that fails validation is sent nowhere and counted abandoned.

Invariant: :func:`decode_to_end` never raises; it says what became of the decode and the
handoff (:class:`ControlDecode`), and its caller counts and judges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from narwhal.engines.client import EngineClient
from narwhal.engines.control import EngineRef
from narwhal.engines.decode import DecodeLeg
from narwhal.engines.handoff_check import checked_handoff
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import Signal
from narwhal.errors import EngineClientError, NarwhalError
from narwhal.reasons import Reason

Fate = Literal["decoded", "received", "released", "abandoned"]
"""What became of the handoff: decoded to ``[DONE]``; received by its consumer (which frees it,
or pulled it); released to another consumer; or abandoned (counted: it waits for the lease)."""


@dataclass(frozen=True, slots=True)
class ControlDecode:
    """A control decode's end: ``error`` None when it reached ``[DONE]``."""

    error: NarwhalError | None
    handoff: Fate


async def decode_to_end(
    client: EngineClient, result: PrefillResult, consumer: EngineRef, body: dict[str, Any], *,
    deadline: float, max_age_s: float, release_to: Sequence[EngineRef] = (),
    frees_refused: Callable[[EngineClientError], bool] | None = None,
) -> ControlDecode:
    """Stream ``result``'s decode on ``consumer`` to ``[DONE]`` under the handoff rules (module
    text); ``release_to``: the consumers its handoff may be given back through when ``consumer``
    never received it (``consumer`` itself is skipped); ``frees_refused``: whether ``consumer``'s
    release frees a handoff whose decode it refused with a 4xx (vLLM 0.21 on; before, the
    refusal keeps the blocks pinned and the handoff is released here, to it first)."""
    leg: DecodeLeg | None = None
    try:
        descriptor = checked_handoff(result, result.endpoint, max_age_s)
        leg = client.decode_leg(result, consumer, body, descriptor, stream=True, deadline=deadline,
                                max_age_s=max_age_s)
        await leg.open()
        while await leg.next_span() is not Signal.END:
            pass
    except NarwhalError as exc:
        if result.crossed and leg is not None and leg.sent and isinstance(exc, EngineClientError) \
                and exc.engine == consumer.name and frees_refused is not None and not frees_refused(exc):
            # Refused, and this consumer's vLLM keeps the blocks pinned: a release frees them.
            return ControlDecode(exc, await give_back(client, result, body, [consumer, *release_to], max_age_s))
        if not result.crossed or (leg is not None and leg.sent):
            return ControlDecode(exc, "received")  # no handoff, or its consumer has it
        if exc.reason in (Reason.INVALID_HANDOFF, Reason.HANDOFF_EXPIRED):
            return ControlDecode(exc, "abandoned")  # sent nowhere: malformed, or past its lease
        return ControlDecode(exc, await give_back(client, result, body, release_to, max_age_s, skip=consumer))
    finally:
        if leg is not None:
            leg.close()
    return ControlDecode(None, "decoded")


async def give_back(
    client: EngineClient, result: PrefillResult, body: dict[str, Any], consumers: Sequence[EngineRef],
    max_age_s: float, skip: EngineRef | None = None,
) -> Fate:
    """Release a handoff nobody will decode to the first of ``consumers`` that takes it in time;
    "abandoned" when none does (or none is there)."""
    for other in consumers:
        if other is skip or other.name == (skip.name if skip is not None else None):
            continue
        outcome = await client.release(result, other, body, max_age_s=max_age_s)
        if outcome == "released":
            return "released"
        if outcome == "failed":  # sent, and that consumer failed: it had the handoff, nobody else may
            return "received"
        if outcome == "expired":
            break
    return "abandoned"
