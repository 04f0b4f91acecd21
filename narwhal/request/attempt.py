"""One attempt, read top to bottom as docs/behaviour.md "The request path"'s named steps.
:meth:`Attempts.run` takes the pair **Placement** reserves, then **Prefill** (``_prefill``, its
answer read by ``_prefilled``), **Handoff validation** (``_handoff``, over
``engines.handoff_check.checked_handoff``, with the handoff's age), **Decode** (``_decode``: the
consumer's stream relayed), and **Cleanup** as the attempt's life ends (the reservation given
back by its state table, an undecoded handoff released), and **A consumer's refusal** where
``_decode`` meets one (``handoff_release.decode_ending``). **Admission** was the router's.

An attempt is one prefill and one decode on a pair placed together (docs/behaviour.md "The
request path"). Its life is an :class:`~narwhal.request.attempt_state.AttemptLife`: every step
is a move the state table allows (placed → prefilling → handed_off → decoding → streaming →
done / failed / detached), and an observer (tracing) learns the attempt from those moves. The
attempt owns both phase reservations, the handoff and the decode connection, and gives each back exactly once however it
ends: the reservations at its end (or, when the client left mid-prefill, in the background task
that now owns them), the decode connection with the leg, and a handoff that will not be decoded
through :class:`~narwhal.request.handoff_release.HandoffReleases`, whose table says, for each way
the decode did not happen, whether the handoff is released and to whom first. Retrying is not
the attempt's business: the router decides from what it raises.

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
from narwhal.engines import failures
from narwhal.engines.client import EngineClient
from narwhal.engines.connector import CheckedHandoff
from narwhal.engines.decode import DecodeLeg
from narwhal.engines.endpoints import GENERATE
from narwhal.engines.handoff_check import checked_handoff
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import Signal, Sink
from narwhal.errors import EngineError, NarwhalError
from narwhal.fleet import Engine
from narwhal.fleet.placement import Reservation
from narwhal.logs import first_across_processes
from narwhal.reasons import Reason
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from narwhal.request.attempt_state import AttemptLife, AttemptObserver, AttemptState
from narwhal.request.client_stream import ClientStream
from narwhal.request.handoff_release import Ending, HandoffReleases, decode_ending
from narwhal.request.ids import backend_id
from narwhal.request.migration import Migration
from narwhal.request.outcomes import Outcomes
from narwhal.request.slot_wait import WaitingPlacement as Placement
from narwhal.request.usage import UsageTap, completion_tokens, wants_usage
from narwhal.settings import Settings

log = logging.getLogger("narwhal.request.attempt")

S = AttemptState


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
    client: ClientStream, leg: DecodeLeg, life: AttemptLife, started: float, ttft_s: float | None,
    age: float | None, tap: UsageTap | None, migration: Migration | None,
) -> web.StreamResponse:
    """Relay an opened stream to the client until its terminal event (docs/behaviour.md "Decode",
    "The other P/D endpoints"); a continuation's spans rewritten (``migration``), and a cut's last
    output noted for it."""
    rec = life.rec
    observed = ended = False
    first_byte_s = None  # this attempt's, when it committed the stream (a continuation did not)
    spans = 0
    edit = migration.passing if migration is not None and migration.editing else None
    try:
        while (span := await leg.next_span()) is not Signal.END:
            if not spans and life.state is not S.STREAMING:
                if not client.committed:
                    rec.first_byte_s = first_byte_s = time.perf_counter() - started
                    await client.commit_stream()
                life.to(S.STREAMING)  # output reached the client: nothing is retried from here
            if span is Signal.BEHIND:  # the relay found the client behind: let it drain
                if edit is not None and migration is not None and migration.unreadable:
                    raise failures.unreadable(life.resv.consumer.name)
                await client.drain()
                continue
            # The span with the terminal event goes out with the end of the chunked body: one
            # write, one client wakeup, instead of a separate 5-byte terminator.
            ended = leg.ended
            if edit is not None and not (span := edit(span)):
                if migration is not None and migration.unreadable:
                    raise failures.unreadable(life.resv.consumer.name)
                if not ended:
                    continue  # a continuation's metadata, not repeated
            await client.write(span, eof=ended)
            spans += 1
            if tap is not None:
                tap.see(span)
            if not observed:
                observed = True
                _observe_start(ttft_s, first_byte_s, age)
        assert client.stream is not None  # next_span ends only after output went out
        if not ended:  # the terminal event's span already ended the body
            await client.write(b"", eof=True)
        _observe_stream_end(rec, started, spans + leg.relayed, tap)
        return client.stream
    except BaseException:
        if migration is not None and life.state is S.STREAMING and (last_at := leg.last_at) is not None:
            migration.last_at = last_at  # this leg's output reached the client: a cut's stall starts here
        raise
    finally:
        if not observed:
            _observe_start(ttft_s, first_byte_s, age)


def _observe_stream_end(rec: AccessRecord, started: float, spans: int, tap: UsageTap | None) -> None:
    """A stream ended cleanly: its usage (when asked for) and its mean gap between the
    spans written to the client — one clock read per stream, none per span."""
    if tap is not None:
        rec.completion_tokens = tap.tokens
    if spans >= 2 and rec.first_byte_s is not None:
        gap = (time.perf_counter() - started - rec.first_byte_s) / (spans - 1)
        metrics.TALLY.observe(metrics.INTER_TOKEN_SAMPLES, gap)


class Attempts:
    """Runs one attempt of a request (:meth:`run`): docs/behaviour.md "The request path" in order,
    **Placement** (the reservation it is given), **Prefill**, **Handoff validation**, **Decode**,
    **Cleanup** and **A consumer's refusal**; the router retries.
    """

    def __init__(
        self,
        settings: Settings,
        placement: Placement,
        client: EngineClient,
        outcomes: Outcomes,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        observer: AttemptObserver | None = None,
    ) -> None:
        self.settings = settings
        self.placement = placement
        self.client = client
        self.outcomes = outcomes
        self.releases = HandoffReleases(settings, placement, client, spawn)
        self.observer = observer  # told of every move of every attempt (tracing), or nobody
        self._loop: asyncio.AbstractEventLoop | None = None  # taken once (engines.timers says why)

    async def run(
        self, client: ClientStream, req: ClientRequest, rec: AccessRecord, started: float, avoid: frozenset[str],
        migration: Migration | None = None, exclude: frozenset[str] = frozenset(),
    ) -> web.StreamResponse:
        """One attempt, docs/behaviour.md "The request path"'s steps in order (**Admission** was
        the router's); raises what the router retries or answers. ``migration``: the stream's, when it may continue
        after a cut (its transcript records what the client is sent; ``req`` may be a continuation);
        ``exclude``: engines never placed on (the consumers that cut the stream)."""
        resv = await self.placement.reserve(req.model, req.deadline, avoid, req.note, req.local, exclude)
        producer, consumer = resv.producer, resv.consumer  # Placement: the pair, both slots held
        rec.producer, rec.consumer = (None if resv.local else producer.name), consumer.name
        request_id = backend_id(rec.request_id, rec.attempts)
        rec.backend_ids.append(request_id)
        life = AttemptLife(resv, rec, request_id, req.forward, self.observer)
        try:
            if resv.local:  # a local decode (docs/behaviour.md "Placement"): no prefill, no handoff
                life.result = self._local(req, resv, rec, request_id)
                ttft_s = descriptor = None
            else:
                life.to(S.PREFILLING)
                result = life.result = await self._prefill(req, life)  # Prefill
                ttft_s = self._prefilled(req, resv, rec, result, started, migration)  # Prefill: its answer
                life.to(S.HANDED_OFF)
                descriptor = self._handoff(req, resv, result, ttft_s)  # Handoff validation
            life.to(S.DECODING)
            response = await self._decode(client, req, life, descriptor, started, ttft_s, migration)  # Decode
            life.to(S.DONE)
        except BaseException as exc:
            streamed = life.state is S.STREAMING  # this attempt's own output reached the client
            life.end(exc)
            self._failed(exc, producer, consumer, before_first_token=not streamed, local=resv.local)
            raise
        else:
            metrics.TALLY.counts[metrics.attempts_child("success")] += 1
            self.outcomes.success(producer, consumer, local=resv.local)
            if resv.note is not None:  # the policy learns where the prompt now is (its consumer)
                resv.decoded(time.monotonic())
            return response
        # Cleanup: ending done or failed gave the slots back (attempt_state.ON_ENTRY); a
        # detached reservation is its background task's.

    def _failed(
        self, exc: BaseException, producer: Engine, consumer: Engine, *, before_first_token: bool, local: bool
    ) -> None:
        """Count a failed attempt by its reason and report an engine's fault to the breakers."""
        if isinstance(exc, EngineError):
            exc.pair = (producer.name, consumer.name)  # what the retry should avoid
            metrics.attempts_child(exc.reason).inc()
            self.outcomes.failure(producer, consumer, exc, before_first_token=before_first_token, local=local)
        elif isinstance(exc, NarwhalError):
            metrics.attempts_child(exc.reason).inc()

    @staticmethod
    def _local(req: ClientRequest, resv: Reservation, rec: AccessRecord, request_id: str) -> PrefillResult:
        """A local decode's result of its own: the consumer, and no descriptor (docs/behaviour.md "Placement")."""
        rec.mode = "local"
        metrics.TALLY.counts[metrics.LOCAL_DECODES] += 1
        if resv.choice != "local":  # a consumer that held the prompt (consumer_holds): its prefill skipped
            metrics.TALLY.counts[metrics.placements_child(resv.choice)] += 1
        consumer = resv.consumer
        return PrefillResult(consumer.name, consumer.url, req.endpoint, request_id, None, crossed=False)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _prefill(self, req: ClientRequest, life: AttemptLife) -> Awaitable[PrefillResult]:
        """**Prefill** (docs/behaviour.md "Prefill"): the prefill leg on the producer, as the
        awaitable of its PrefillResult. A plain function returning the leg's coroutine: no frame
        of its own to resume on every wakeup of the prefill."""
        resv = life.resv
        life.rec.mode = "disaggregated" if resv.crossed else "same_worker"
        metrics.TALLY.counts[metrics.placements_child(resv.choice)] += 1

        def detach(rest: Awaitable[PrefillResult]) -> None:
            # The client left mid-prefill: the prefill finishes in the background, which now
            # owns the reservation, and its handoff is released then.
            life.to(S.DETACHED)
            self.releases.detach(rest, req, resv)

        return self.client.prefill(
            resv.producer,
            req.endpoint,
            req.body if not resv.report_full else req.endpoint.dialect.full_report(req.body),
            request_id=life.request_id,
            crossed=resv.crossed,
            deadline=req.deadline,
            headers=life.forward,
            on_abandon=detach,
        )

    def _prefilled(
        self, req: ClientRequest, resv: Reservation, rec: AccessRecord, result: PrefillResult, started: float,
        migration: Migration | None,
    ) -> float | None:
        """**Prefill**, its answer (docs/behaviour.md "Prefill"): what the PrefillResult says
        (TTFT, returned; tokens; the placement policy's note, for the access log and its
        ``prefilled`` hook). A continuation's prefill leaves the request's TTFT and prompt alone.
        The prefill slot goes back as the attempt moves on to ``handed_off``
        (``attempt_state.ON_ENTRY``): nothing here awaits, so that is as soon as before."""
        metrics.count_prefill_tokens(result.prompt_tokens, result.cached_tokens)
        ttft_s = None
        if migration is None or not migration.count:
            rec.ttft_s = ttft_s = time.perf_counter() - started
            rec.prompt_tokens, rec.cached_tokens = result.prompt_tokens, result.cached_tokens
        if resv.note is not None:  # the placement policy keeps a note of it, carried unread
            rec.placed = resv.note
            # Runs at the decode's first wait: what the policy does of it is off the critical path.
            self._running_loop().call_soon(resv.prefilled, result)
        return ttft_s

    def _handoff(
        self, req: ClientRequest, resv: Reservation, result: PrefillResult, ttft_s: float | None
    ) -> CheckedHandoff | None:
        """**Handoff validation** (docs/behaviour.md "Handoff validation"; none for a same-worker
        decode) and the handoff's age: the descriptor the decode carries. A rejected one is sent
        nowhere (counted abandoned: a malformed one could crash a consumer), and so is an expired
        one (docs/decisions.md "vLLM releases")."""
        try:
            descriptor = checked_handoff(result, result.endpoint, self.settings.handoff.max_age_s)
            if descriptor is not None and descriptor.get("transfer_mode", resv.producer.transfer_mode) \
                    != resv.producer.transfer_mode:
                _mode_disagrees(resv.producer, descriptor.get("transfer_mode"))
            return descriptor
        except NarwhalError as exc:
            if exc.reason in (Reason.INVALID_HANDOFF, Reason.HANDOFF_EXPIRED):
                self.releases.end(Ending.REJECTED, result, req, resv)
            _observe_start(ttft_s, None, result.age())
            raise

    async def _decode(
        self,
        client: ClientStream,
        req: ClientRequest,
        life: AttemptLife,
        descriptor: CheckedHandoff | None,
        started: float,
        ttft_s: float | None,
        migration: Migration | None,
    ) -> web.StreamResponse:
        """**Decode** (docs/behaviour.md "Decode"): decode on the consumer and relay what it sends,
        then, for a decode that did not happen, **Cleanup** or **A consumer's refusal**
        (``handoff_release.decode_ending``). ``life.rec`` is only
        written: what the client was sent is ``client.committed``."""
        resv, rec, result = life.resv, life.rec, life.result
        assert result is not None  # the prefill's, or a local decode's own
        leg = None
        age = None if resv.local else result.age()
        streaming = False  # _stream observes the start histograms itself
        sink: Sink | None = None
        tap: UsageTap | None = None
        if req.stream:
            sink = outlet = client.relay_sink()
            if migration is not None:
                outlet.transcript = migration.transcript  # the client's writes keep what it was sent
            if wants_usage(req.body):
                sink = tap = UsageTap(sink)
            if migration is not None:
                sink = migration.sink(sink)  # a continuation's rewrite in front, while one runs
        first_byte_s: float | None = None
        try:
            leg = self.client.decode_leg(
                result, resv.consumer, req.body, descriptor, stream=req.stream, deadline=req.deadline,
                headers=life.forward, sink=sink, max_age_s=self.settings.handoff.max_age_s,
            )
            whole = await leg.open()
            if whole is not None:
                rec.first_byte_s = first_byte_s = time.perf_counter() - started
                rec.completion_tokens = completion_tokens(whole)
                return await client.send_whole(whole)
            streaming = True
            return await _stream(client, leg, life, started, ttft_s, age, tap, migration)
        except NarwhalError as exc:
            # Cleanup, or A consumer's refusal: never sent (the consumer never saw the handoff), or
            # refused by a consumer that keeps it.
            ending = decode_ending(exc, leg is None or leg.sent, resv.consumer, req.endpoint is GENERATE)
            if ending is not None:
                self.releases.end(ending, result, req, resv)
            raise
        except (asyncio.CancelledError, ConnectionError):
            if life.state is not S.STREAMING:  # before this leg's output (a continuation's too)
                self.releases.end(Ending.CLIENT_LEFT_BEFORE_ANSWER, result, req, resv)
            raise
        finally:
            if leg is not None:
                leg.close()
            if not streaming:
                _observe_start(ttft_s, first_byte_s, age)


_MODE_WARNED: set[str] = set()  # producers whose disagreement this worker has seen (no file asked again)


def _mode_disagrees(producer: Engine, said: Any) -> None:
    """docs/decisions.md "vLLM releases": a producer's descriptor names another transfer mode than
    its setting: a warning, once per engine across the router (docs/behaviour.md: the first worker
    to see it says it): the pairs are chosen by the setting, so fix one or the other."""
    if producer.name in _MODE_WARNED:
        return
    _MODE_WARNED.add(producer.name)
    if first_across_processes(f"transfer-mode {producer.name} {said!r} {producer.transfer_mode}"):
        log.warning("engine %s: its handoffs say transfer_mode %r, its engines[].transfer_mode is %r: pairs "
                    "are chosen by the setting", producer.name, said, producer.transfer_mode)
