"""One attempt, read top to bottom as SPEC §3's steps: :meth:`Attempts.run` reserves the pair (2),
runs the prefill (3, ``_prefill_step``), reads its result (4, ``_prefilled``), checks the handoff
as a step of its own (5, and step 6's age rule: ``_handoff``, over
``engines.decode.checked_handoff``), decodes and relays (6-7, ``_decode``), reports the outcome
and releases in ``finally`` (8).

An attempt is one prefill and one decode on a pair placed together (SPEC §3). It owns both
phase reservations, the handoff and the decode connection, and gives each back exactly once
however it ends: the reservations in ``finally`` (or, when the client left mid-prefill, in the
background task that now owns them), the decode connection with the leg, and a handoff that
will not be decoded by releasing it (SPEC §3 step 8) — the four cases, here, side by side:
the client gone before the consumer answered, the handoff expired, the decode never sent
(connecting to the consumer failed or ran out of time: refused, first-token timeout or the
deadline), the client gone mid-prefill. Retrying is not its business: the router decides from
what it raises.

Where a release goes: vLLM frees a producer's blocks only when a consumer pulls them, so the
handoff goes to the first consumer that can be reached — the chosen one, then the producer's
other permitted consumers (``Placement.release_consumers``; the chosen one last when its own
connect just failed). Only when none can be reached, or the descriptor does not validate (a
malformed one could crash a consumer's EngineCore), is it counted abandoned. A release holds
no reservation slot: it is a one-token, non-streaming decode lasting milliseconds, and waiting
for a slot would keep the blocks pinned while making clients wait behind it.

What the client sees is :class:`narwhal.request.client_stream.ClientStream`'s; what the engine
did is the decode leg's (``narwhal.engines.decode``); the attempt connects the two and reports
the outcome (``narwhal.request.outcomes``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from narwhal import metrics
from narwhal.engines.client import EngineClient
from narwhal.engines.connector import InvalidHandoff, PrefillResult, validate_descriptor
from narwhal.engines.decode import DecodeLeg, checked_handoff
from narwhal.engines.relay import Signal, Sink
from narwhal.errors import EngineClientError, EngineError, NarwhalError
from narwhal.fleet import Engine, compat
from narwhal.fleet.placement import Reservation
from narwhal.reasons import Reason
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from narwhal.request.client_stream import ClientStream
from narwhal.request.ids import backend_id
from narwhal.request.outcomes import Outcomes
from narwhal.request.slot_wait import WaitingPlacement as Placement
from narwhal.request.usage import UsageTap, completion_tokens, wants_usage
from narwhal.settings import Settings

log = logging.getLogger("narwhal.request.attempt")


def _observe_start(ttft_s: float | None, first_byte_s: float | None, handoff_age: float | None) -> None:
    # Observed once the first output is on its way to the client (or the attempt ended), not
    # on the way to it: the histograms' timing does not matter, the first token's does.
    if ttft_s is not None:
        metrics.TALLY.observe(metrics.TTFT_SAMPLES, ttft_s)
    if handoff_age is not None:  # a local decode had no handoff
        metrics.TALLY.observe(metrics.HANDOFF_AGE_SAMPLES, handoff_age)
    if first_byte_s is not None:
        metrics.TALLY.observe(metrics.FIRST_BYTE_SAMPLES, first_byte_s)


async def _stream(
    client: ClientStream, leg: DecodeLeg, rec: AccessRecord, started: float, ttft_s: float | None,
    age: float | None, tap: UsageTap | None,
) -> web.StreamResponse:
    """Relay an opened stream to the client until its terminal event (SPEC §3 step 7, §2.1)."""
    observed = ended = False
    spans = 0
    try:
        while (span := await leg.next_span()) is not Signal.END:
            if not client.committed:
                rec.first_byte_s = time.perf_counter() - started
                await client.commit_stream()
            if span is Signal.BEHIND:  # the relay found the client behind: let it drain
                await client.drain()
                continue
            # The span with the terminal event goes out with the end of the chunked body: one
            # write, one client wakeup, instead of a separate 5-byte terminator.
            ended = leg.ended
            await client.write(span, eof=ended)
            spans += 1
            if tap is not None:
                tap.see(span)
            if not observed:
                observed = True
                _observe_start(ttft_s, rec.first_byte_s, age)
        assert client.stream is not None  # next_span ends only after output went out
        if not ended:  # the terminal event's span already ended the body
            await client.write(b"", eof=True)
        _observe_stream_end(rec, started, spans + leg.relayed, tap)
        return client.stream
    finally:
        if not observed:
            _observe_start(ttft_s, rec.first_byte_s, age)


def _observe_stream_end(rec: AccessRecord, started: float, spans: int, tap: UsageTap | None) -> None:
    """A stream ended cleanly: its usage (when asked for) and its mean gap between the
    spans written to the client — one clock read per stream, none per span."""
    if tap is not None:
        rec.completion_tokens = tap.tokens
    if spans >= 2 and rec.first_byte_s is not None:
        gap = (time.perf_counter() - started - rec.first_byte_s) / (spans - 1)
        metrics.TALLY.observe(metrics.INTER_TOKEN_SAMPLES, gap)


class Attempts:
    """Runs one attempt of a request, SPEC §3 steps 2-8 in order (:meth:`run`); the router retries."""

    def __init__(
        self,
        settings: Settings,
        placement: Placement,
        client: EngineClient,
        outcomes: Outcomes,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.settings = settings
        self.placement = placement
        self.client = client
        self.outcomes = outcomes
        self.spawn = spawn  # runs a coroutine in the background, owned by the router
        self._loop: asyncio.AbstractEventLoop | None = None  # taken once (engines.timers says why)

    async def run(
        self, client: ClientStream, req: ClientRequest, rec: AccessRecord, started: float, avoid: frozenset[str]
    ) -> web.StreamResponse:
        """One attempt, SPEC §3's steps in order (step 1, admission, was the router's); raises
        what the router retries or answers."""
        resv = await self.placement.reserve(req.model, req.deadline, avoid, req.affinity, req.local, req.blocks)
        producer, consumer = resv.producer, resv.consumer  # 2. placement: the pair, both slots held
        rec.producer, rec.consumer = (None if resv.local else producer.name), consumer.name
        try:
            result = await self._prefill_step(req, resv, rec)  # 3. prefill (none for a local decode)
            ttft_s = self._prefilled(req, resv, rec, result, started)  # 4. the PrefillResult
            descriptor = self._handoff(req, resv, result, rec, ttft_s)  # 5. validation (and 6's age rule)
            response = await self._decode(client, req, resv, result, descriptor, rec, started, ttft_s)  # 6-7.
        except EngineError as exc:
            exc.pair = (producer.name, consumer.name)  # what the retry should avoid
            metrics.attempts_child(exc.reason).inc()
            self.outcomes.failure(producer, consumer, exc, before_first_token=not client.committed, local=resv.local)
            raise
        except NarwhalError as exc:
            metrics.attempts_child(exc.reason).inc()
            raise
        else:
            metrics.TALLY.counts[metrics.attempts_child("success")] += 1
            self.outcomes.success(producer, consumer, local=resv.local)
            return response
        finally:
            if not resv.detached:  # 8. cleanup (a detached reservation is its background task's)
                resv.release()

    def _prefill_step(self, req: ClientRequest, resv: Reservation, rec: AccessRecord) -> Awaitable[PrefillResult]:
        """SPEC §3 step 3: the prefill leg on the producer, as the awaitable of its PrefillResult;
        a local decode (§3.2) has no prefill, and a result of its own with no descriptor. A
        plain function, like ``_prefill``: no frame of its own to resume on every wakeup."""
        request_id = backend_id(rec.request_id, rec.attempts)
        rec.backend_ids.append(request_id)
        if not resv.local:
            rec.mode = "disaggregated" if resv.crossed else "same_worker"
            metrics.TALLY.counts[metrics.placements_child(resv.choice)] += 1
            return self._prefill(req, resv, request_id)
        rec.mode = "local"
        metrics.TALLY.counts[metrics.LOCAL_DECODES] += 1
        consumer = resv.consumer
        local = self._running_loop().create_future()  # done: awaiting it does not suspend
        local.set_result(PrefillResult(consumer.name, consumer.url, req.endpoint, request_id, None, crossed=False))
        return local

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _prefilled(
        self, req: ClientRequest, resv: Reservation, rec: AccessRecord, result: PrefillResult, started: float
    ) -> float | None:
        """SPEC §3 step 4: what the PrefillResult says (TTFT, returned; tokens; the producer's
        holdings report); nothing for a local decode."""
        if resv.local:
            return None
        resv.release_prefill()
        rec.ttft_s = ttft_s = time.perf_counter() - started
        rec.prompt_tokens, rec.cached_tokens = result.prompt_tokens, result.cached_tokens
        metrics.count_prefill_tokens(result.prompt_tokens, result.cached_tokens)
        if req.blocks is not None:
            rec.predicted_cached_chars = resv.predicted_chars
            # Runs at the decode's first wait: the keys are finished off the critical path.
            self._running_loop().call_soon(self.outcomes.prefilled, resv.producer, req.blocks, result,
                                                 resv.queued_chars)
        return ttft_s

    def _prefill(self, req: ClientRequest, resv: Reservation, request_id: str) -> Awaitable[PrefillResult]:
        # A plain function returning the leg's coroutine: no frame of its own to resume on
        # every wakeup of the prefill.
        def abandon(rest: Awaitable[PrefillResult]) -> None:
            # The client left mid-prefill. Let the prefill finish and release its handoff in
            # the background, which now owns the reservation.
            resv.detached = True
            self.spawn(self._finish_abandoned_prefill(rest, req, resv))

        return self.client.prefill(
            resv.producer,
            req.endpoint,
            req.body,
            request_id=request_id,
            crossed=resv.crossed,
            deadline=req.deadline,
            headers=req.forward,
            on_abandon=abandon,
        )

    def _handoff(
        self, req: ClientRequest, resv: Reservation, result: PrefillResult, rec: AccessRecord, ttft_s: float | None
    ) -> dict[str, Any] | None:
        """SPEC §3 step 5 (none for a same-worker or local decode) and step 6's age rule: the
        descriptor the decode carries. A rejected one is sent nowhere (counted abandoned: a
        malformed one could crash a consumer), and so is an expired one (SPEC §11). ``rec``: the
        attempt's, for a traced subclass."""
        try:
            descriptor = checked_handoff(result, result.endpoint, self.settings.handoff.max_age_s)
            if descriptor is not None and descriptor.get("transfer_mode", resv.producer.transfer_mode) \
                    != resv.producer.transfer_mode:
                _mode_disagrees(resv.producer, descriptor.get("transfer_mode"))
            return descriptor
        except NarwhalError as exc:
            if exc.reason in (Reason.INVALID_HANDOFF, Reason.HANDOFF_EXPIRED):
                # Sent nowhere: no consumer could use a malformed one, and an expired one's blocks
                # may belong to another request by now (SPEC §11, the lease).
                metrics.HANDOFFS_ABANDONED.inc()
            _observe_start(ttft_s, None, None if resv.local else result.age())
            raise

    async def _decode(
        self,
        client: ClientStream,
        req: ClientRequest,
        resv: Reservation,
        result: PrefillResult,
        descriptor: dict[str, Any] | None,
        rec: AccessRecord,
        started: float,
        ttft_s: float | None,
    ) -> web.StreamResponse:
        """Decode on the consumer and relay what it sends (SPEC §3 steps 6-7). ``rec`` is only
        written: what the client was sent is ``client.committed``."""
        leg = None
        age = None if resv.local else result.age()
        streaming = False  # _stream observes the start histograms itself
        sink: Sink | None = None
        tap: UsageTap | None = None
        if req.stream:
            sink = client.relay_sink()
            if wants_usage(req.body):
                sink = tap = UsageTap(sink)
        first_byte_s: float | None = None
        try:
            leg = self.client.decode_leg(
                result, resv.consumer, req.body, descriptor, stream=req.stream, deadline=req.deadline,
                headers=req.forward, sink=sink,
            )
            resv.decode_sent()
            whole = await leg.open()
            if whole is not None:
                rec.first_byte_s = first_byte_s = time.perf_counter() - started
                rec.completion_tokens = completion_tokens(whole)
                return await client.send_whole(whole)
            streaming = True
            return await _stream(client, leg, rec, started, ttft_s, age, tap)
        except NarwhalError as exc:
            if leg is not None and not leg.sent:
                # Connecting ran out of time or was refused: the consumer never saw the handoff.
                # An engine fault (refused, first-token timeout) says it is unreachable: try it
                # last; the request's deadline says nothing about it.
                self._release_later(result, req, resv, chosen_first=not isinstance(exc, EngineError))
            elif refused_undecoded(exc, resv.consumer):
                self._release_later(result, req, resv)  # the same consumer first: a release is one token
            raise
        except (asyncio.CancelledError, ConnectionError):
            if not client.committed and result.descriptor is not None:
                # Gone before the consumer answered: it may never have queued the request.
                self._release_later(result, req, resv)
            raise
        finally:
            if leg is not None:
                leg.close()
            if not streaming:
                _observe_start(ttft_s, first_byte_s, age)

    def _release_later(
        self, result: PrefillResult, req: ClientRequest, resv: Reservation, *, chosen_first: bool = True
    ) -> None:
        """Release the handoff in the background, unless nobody could read it (same-worker, none)."""
        if result.descriptor is not None and result.crossed:
            consumers = self.placement.release_consumers(resv.producer, resv.consumer, req.model,
                                                         chosen_first=chosen_first)
            self.spawn(self._release(result, req, consumers))

    async def _release(self, result: PrefillResult, req: ClientRequest, consumers: list[Engine]) -> None:
        """Validate the handoff, then give it to the first of ``consumers`` that can be reached
        (a consumer that was sent it and failed had its chance: it may be pulling the blocks)."""
        try:
            validate_descriptor(result.descriptor, producer=result.producer, prefill_endpoint=result.endpoint.path,
                                decode_endpoint=result.endpoint.path)
        except InvalidHandoff:
            metrics.HANDOFFS_ABANDONED.inc()  # sent nowhere (SPEC §3 step 5)
            return
        outcome = "unreachable"
        for consumer in consumers:
            outcome = await self.client.release(result, consumer, req.body, headers=req.forward,
                                                max_age_s=self.settings.handoff.max_age_s)
            if outcome != "unreachable":
                break
        (metrics.HANDOFFS_RELEASED if outcome == "released" else metrics.HANDOFFS_ABANDONED).inc()

    async def _finish_abandoned_prefill(
        self, task: Awaitable[PrefillResult], req: ClientRequest, resv: Reservation
    ) -> None:
        try:
            result = await task
        except Exception:
            return  # the prefill failed: there is no handoff to free
        finally:
            resv.release()  # before the handoff's release, which holds no slot
        if result.crossed:
            await self._release(result, req, self.placement.release_consumers(
                resv.producer, resv.consumer, req.model, chosen_first=True))


def refused_undecoded(exc: NarwhalError, consumer: Engine) -> bool:
    """The consumer refused the decode with a 4xx and its vLLM leaves the producer's blocks pinned
    (SPEC §11 "a consumer's refusal": before 0.21.0, or an unknown version), so Narwhal releases
    the handoff itself; a consumer that frees it needs no second word."""
    return (isinstance(exc, EngineClientError) and exc.engine == consumer.name and exc.phase == "decode"
            and not compat.frees_refused_decode(consumer.version))


_MODE_WARNED: set[str] = set()  # producers whose descriptor's transfer mode this worker warned about


def _mode_disagrees(producer: Engine, said: Any) -> None:
    """SPEC §11: a producer's descriptor names another transfer mode than its setting: a warning,
    once per engine (per worker): the pairs are chosen by the setting, so fix one or the other."""
    if producer.name not in _MODE_WARNED:
        _MODE_WARNED.add(producer.name)
        log.warning("engine %s: its handoffs say transfer_mode %r, its engines[].transfer_mode is %r: pairs "
                    "are chosen by the setting", producer.name, said, producer.transfer_mode)
