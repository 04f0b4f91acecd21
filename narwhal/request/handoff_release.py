"""Every way a handoff that will not be decoded ends, in one table (docs/behaviour.md "Cleanup",
"A consumer's refusal", docs/decisions.md "vLLM releases").

A producer's vLLM pins a prompt's KV blocks from the prefill until a consumer pulls them (or
its ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` runs out, minutes later). So every handoff an attempt
made is either decoded, or *released* here: sent as a one-token, non-streaming decode to a
consumer that pulls and frees the blocks, or, when no consumer could read it, counted
*abandoned*. :data:`RULES` says which, for each way the decode did not happen
(:class:`Ending`), and whom to ask first:

- the chosen consumer first when it is reachable (a release is one token, and it is the pair
  the producer's descriptor was made for);
- the chosen consumer last when connecting to it just failed (it is probably unreachable).

Where a release goes: the chosen consumer and the producer's other compatible consumers
(``Placement.release_consumers``, docs/decisions.md "vLLM releases"'s pair rule), the first that can be reached. Only
when none can, or the descriptor does not validate (a malformed one could crash a consumer's
EngineCore), is it counted abandoned. A release holds no reservation slot: it lasts
milliseconds, and waiting for a slot would keep the blocks pinned while clients wait behind it.
Nothing here runs on the client's critical path: releases are background tasks.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from narwhal import metrics
from narwhal.engines.client import EngineClient
from narwhal.engines.connector import InvalidHandoff, validate_descriptor
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import EngineClientError, EngineError, NarwhalError
from narwhal.fleet import Engine, compat
from narwhal.fleet.placement import Reservation
from narwhal.request.admission import ClientRequest
from narwhal.request.slot_wait import WaitingPlacement as Placement
from narwhal.settings import Settings


class Ending(enum.Enum):
    """How an attempt came to hold a handoff it will not decode."""

    CLIENT_LEFT_MID_PREFILL = "the client left while the producer prefilled"
    REJECTED = "the descriptor is invalid, or past handoff.max_age_s"
    NOT_SENT_CONSUMER_FAULT = "connecting to the consumer was refused or timed out"
    NOT_SENT_DEADLINE = "the request's deadline ran out before the consumer had the decode"
    CONSUMER_REFUSED = "the consumer refused the decode with a 4xx and its vLLM keeps the blocks"
    CLIENT_LEFT_BEFORE_ANSWER = "the client left before the consumer answered"


@dataclass(frozen=True, slots=True)
class Rule:
    """What becomes of the handoff: released (to whom first) or abandoned, sent nowhere."""

    release: bool
    chosen_first: bool = True


RULES: dict[Ending, Rule] = {
    # The prefill runs on in the background (it owns the reservation), then its handoff goes.
    Ending.CLIENT_LEFT_MID_PREFILL: Rule(release=True),
    # No consumer could use a malformed one; an expired one's blocks may be another request's.
    Ending.REJECTED: Rule(release=False),
    # The consumer never saw it, and is probably unreachable: ask it last.
    Ending.NOT_SENT_CONSUMER_FAULT: Rule(release=True, chosen_first=False),
    # The consumer never saw it; the deadline says nothing about the consumer.
    Ending.NOT_SENT_DEADLINE: Rule(release=True),
    # docs/decisions.md "vLLM releases" "a consumer's refusal": it answered, so it is reachable, and a release is one
    # token.
    Ending.CONSUMER_REFUSED: Rule(release=True),
    # The consumer may never have queued the request.
    Ending.CLIENT_LEFT_BEFORE_ANSWER: Rule(release=True),
}
"""For each :class:`Ending`: release the handoff, or count it abandoned."""


def decode_ending(exc: NarwhalError, sent: bool, consumer: Engine, generate: bool = False) -> Ending | None:
    """The :class:`Ending` of a decode that failed with ``exc``; None when the consumer had the
    handoff and frees it itself (it pulled the blocks, or its vLLM frees a refused one)."""
    if not sent:
        return Ending.NOT_SENT_CONSUMER_FAULT if isinstance(exc, EngineError) else Ending.NOT_SENT_DEADLINE
    if refused_undecoded(exc, consumer, generate):
        return Ending.CONSUMER_REFUSED
    return None


def refused_undecoded(exc: NarwhalError, consumer: Engine, generate: bool = False) -> bool:
    """The consumer refused the decode with a 4xx and its vLLM left the producer's blocks pinned
    (docs/behaviour.md, "A consumer's refusal": before 0.21.0 or an unknown version, the generate
    endpoint, or a request-validation 400; ``compat.frees_refused_decode``), so Narwhal releases
    the handoff itself; a consumer that freed it must get no second word (a late read)."""
    return (isinstance(exc, EngineClientError) and exc.engine == consumer.name and exc.phase == "decode"
            and not compat.frees_refused_decode(consumer.version, generate, exc.engine_type))


class HandoffReleases:
    """Applies :data:`RULES`: releases in background tasks, abandonments counted."""

    def __init__(
        self,
        settings: Settings,
        placement: Placement,
        client: EngineClient,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.max_age_s = settings.handoff.max_age_s
        self.placement = placement
        self.client = client
        self.spawn = spawn  # runs a coroutine in the background, owned by the router

    def end(self, ending: Ending, result: PrefillResult, req: ClientRequest, resv: Reservation) -> None:
        """The handoff in ``result`` will not be decoded because of ``ending``: release it in the
        background, or count it abandoned, as :data:`RULES` says."""
        consumers = self._consumers(ending, result, req, resv)
        if consumers is not None:
            self.spawn(self._release(result, req, consumers))

    def detach(self, rest: Awaitable[PrefillResult], req: ClientRequest, resv: Reservation) -> None:
        """The client left mid-prefill: let the prefill finish in the background, which now
        owns the reservation, and release its handoff then."""
        self.spawn(self._finish_detached(rest, req, resv))

    def _consumers(
        self, ending: Ending, result: PrefillResult, req: ClientRequest, resv: Reservation
    ) -> list[Engine] | None:
        """Whom to offer the handoff, in order; None when it is not to be released (counted
        abandoned when :data:`RULES` says so; a handoff nobody could read, a same-worker
        decode's or none, needs nothing)."""
        if not result.crossed:
            return None  # a same-worker decode's: no handoff, nothing pinned, nothing counted
        rule = RULES[ending]
        if not rule.release:
            metrics.HANDOFFS_ABANDONED.inc()
            return None
        if result.descriptor is None:
            return None
        return self.placement.release_consumers(resv.producer, resv.consumer, req.model,
                                                chosen_first=rule.chosen_first)

    async def _finish_detached(self, rest: Awaitable[PrefillResult], req: ClientRequest, resv: Reservation) -> None:
        try:
            result = await rest
        except Exception:
            return  # the prefill failed: there is no handoff to free
        finally:
            resv.release()  # before the handoff's release, which holds no slot
        consumers = self._consumers(Ending.CLIENT_LEFT_MID_PREFILL, result, req, resv)
        if consumers is not None:
            await self._release(result, req, consumers)

    async def _release(self, result: PrefillResult, req: ClientRequest, consumers: list[Engine]) -> None:
        """Validate the handoff, then give it to the first of ``consumers`` that can be reached
        (a consumer that was sent it and failed had its chance: it may be pulling the blocks)."""
        try:
            validate_descriptor(result.descriptor, producer=result.producer, prefill_endpoint=result.endpoint.path,
                                decode_endpoint=result.endpoint.path)
        except InvalidHandoff:
            metrics.HANDOFFS_ABANDONED.inc()  # sent nowhere (docs/behaviour.md "Cleanup")
            return
        outcome = "unreachable"
        for consumer in consumers:
            outcome = await self.client.release(result, consumer, req.body, headers=req.forward,
                                                max_age_s=self.max_age_s)
            if outcome != "unreachable":
                break
        (metrics.HANDOFFS_RELEASED if outcome == "released" else metrics.HANDOFFS_ABANDONED).inc()
