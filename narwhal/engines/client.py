"""HTTP to vLLM engines: the prefill leg, the decode leg and handoff release, over one pool.

The policy of each leg lives here (what is sent, under which bound, what its answer means);
the wire is :mod:`narwhal.engines.http1`, a lean pooled HTTP/1.1 client (see there why not
aiohttp's client on this path); a decode's steps are :mod:`narwhal.engines.decode`; how a
failure becomes a reason is :mod:`narwhal.engines.failures`, the one place for that.

Timeouts are deadlines (loop time, ``failures.leg_bound``) enforced by the connection, one timer per
exchange, so "the first token within N seconds" covers connect and response headers too
(docs/behaviour.md "Failure semantics"); after the headers each relay read has its own bound, so no
total timeout ever ends a long generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, Literal, Unpack

import orjson

from narwhal.engines import failures
from narwhal.engines.connector import CheckedHandoff
from narwhal.engines.control import EngineRef, auth_line, ssl_context
from narwhal.engines.decode import DecodeContext, DecodeLeg, DecodeOptions, LegOptions
from narwhal.engines.dialects.base import token_count
from narwhal.engines.endpoints import Endpoint
from narwhal.engines.failures import Wait
from narwhal.engines.handoff_check import checked_handoff
from narwhal.engines.http1 import Connection, UpstreamPool, header_lines
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import Signal
from narwhal.engines.sse import Budget
from narwhal.errors import EngineError, Phase
from narwhal.settings import EngineSettings

ReleaseOutcome = Literal["released", "failed", "unreachable", "expired"]
"""What became of a release: ``released``, the consumer answered 200 (it pulled the blocks);
``failed``, it was sent and the consumer failed or went silent (it had the handoff: another
consumer must not pull it too), or there was no descriptor; ``unreachable``, nothing was sent
(connecting failed or ran out of time), so another consumer may still take it; ``expired``,
nothing was sent because the handoff reached ``handoff.max_age_s`` (docs/decisions.md "vLLM releases": the producer's
lease may be over and its blocks someone else's), so nobody may take it."""


class EngineClient:
    """Prefill, decode and release against vLLM engines over one connection pool.

    ``prefill(...) -> PrefillResult``; pass the result unchanged to ``decode(...)``, an async
    generator of response bytes: for a stream, spans of whole SSE events as received (the
    first span holds the first generated token, with any metadata before it); for a
    non-streaming request, the whole body once. Every failure raises an ``EngineError``.
    """

    def __init__(self, pool: UpstreamPool, settings: EngineSettings) -> None:
        self.pool = pool
        self.settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None  # taken at the first leg (engines.timers says why)
        self._auth = auth_line(settings)  # the one engine header (engines.control), prebuilt
        # What a decode leg sees of this client (engines.decode imports nothing from here).
        self.decode_context = DecodeContext(pool.post, self.engine_headers, settings.first_token_timeout_s,
                                            settings.decode_read_timeout_s)

    def charge_events_to(self, budget: Budget) -> None:
        """Decode legs charge what an unfinished SSE event holds past ``sse.CHARGED_FROM`` to
        ``budget``, the worker's stream buffers (``server.max_buffered_mib``)."""
        self.decode_context = dataclasses.replace(self.decode_context, budget=budget)

    @classmethod
    def for_settings(cls, settings: EngineSettings) -> EngineClient:
        """A client with its own pool, verifying ``https://`` engines as every caller does."""
        return cls(UpstreamPool(ssl_context(settings.ca_file)), settings)

    async def close(self) -> None:
        """Close every connection of the pool, idle or in use."""
        await self.pool.close()

    def engine_headers(self, request_id: str, extra: Mapping[str, str] | None) -> bytes:
        """Every leg's header lines: ``X-Request-Id``, the engine key, then ``extra`` (the
        client's forwarded headers); a request id holding CR or LF is refused."""
        if "\r" in request_id or "\n" in request_id:
            raise ValueError("a request id may not hold CR or LF")
        lines = b"X-Request-Id: " + request_id.encode("latin-1") + b"\r\n" + self._auth
        return lines + header_lines(extra) if extra else lines

    async def _exchange(
        self,
        url: str,
        endpoint: str,
        headers: bytes,
        payload: bytes,
        bound: float,
        on_abandon: Callable[[Awaitable[tuple[int, bytes]]], None] | None = None,
    ) -> tuple[int, bytes]:
        """POST and read the whole answer within ``bound`` (loop time). Cancelled once the
        request is out, the rest of the answer goes to ``on_abandon`` when given (else the
        connection is closed, which makes the engine abort)."""
        conn = await self.pool.post(url, endpoint, headers, payload, deadline=bound)
        try:
            return await _answer(conn)
        except asyncio.CancelledError:
            if on_abandon is None:
                conn.close()
            else:
                on_abandon(self._rest(conn))
            raise
        except BaseException:
            conn.close()
            raise

    @staticmethod
    async def _rest(conn: Connection) -> tuple[int, bytes]:
        try:
            return await _answer(conn)
        except BaseException:
            conn.close()
            raise

    async def prefill(
        self,
        producer: EngineRef,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        request_id: str,
        crossed: bool = True,
        deadline: float | None = None,
        headers: Mapping[str, str] | None = None,
        on_abandon: Callable[[Awaitable[PrefillResult]], None] | None = None,
    ) -> PrefillResult:
        """Run the prefill leg on ``producer``; bounded by ``prefill_timeout_s`` and ``deadline``.

        ``deadline`` is in ``loop.time()`` units. ``crossed=False`` (same-worker decode) sends
        no ``kv_transfer_params`` and returns a result without a descriptor. With
        ``on_abandon``, a caller cancelled after the request went out does not abort it: the
        rest of the prefill is handed to ``on_abandon`` as an awaitable of the result (to run
        in the background and release its handoff) — no task is spent on the common path.
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        result = PrefillResult(
            producer=producer.name,
            producer_url=producer.url,
            endpoint=endpoint,
            request_id=request_id,
            descriptor=None,
            crossed=crossed,
        )
        bound = failures.leg_bound(loop.time(), self.settings.prefill_timeout_s, deadline)
        payload = orjson.dumps(endpoint.dialect.prefill_body(body, request_id, crossed))
        on_rest = None
        if on_abandon is not None:
            abandon = on_abandon

            def on_rest(rest: Awaitable[tuple[int, bytes]]) -> None:
                abandon(self._finish_prefill(rest, result))

        head = self.engine_headers(request_id, headers)
        with failures.WireFailures(producer.name, "prefill", deadline, Wait.PREFILL, self.settings.prefill_timeout_s,
                                   bound):
            status, data = await self._exchange(producer.url, endpoint.path, head, payload, bound, on_rest)
        return _prefill_result(result, status, data)

    @staticmethod
    async def _finish_prefill(rest: Awaitable[tuple[int, bytes]], result: PrefillResult) -> PrefillResult:
        status, data = await rest
        return _prefill_result(result, status, data)

    def decode_leg(
        self, result: PrefillResult, consumer: EngineRef, body: dict[str, Any], descriptor: CheckedHandoff | None,
        **options: Unpack[LegOptions],
    ) -> DecodeLeg:
        """The decode as an object with named steps (``narwhal.engines.decode``), carrying
        ``descriptor`` as :func:`~narwhal.engines.handoff_check.checked_handoff` returned it: ``open()``,
        ``next_span()`` until ``Signal.END``, and ``close()`` always."""
        return DecodeLeg(self.decode_context, result, consumer, body, descriptor, loop=self._loop, **options)

    async def decode(
        self, result: PrefillResult, consumer: EngineRef, body: dict[str, Any], **options: Unpack[DecodeOptions]
    ) -> AsyncGenerator[bytes, None]:
        """Validate the handoff, then decode on ``consumer`` and yield the response bytes.

        Use it under ``contextlib.aclosing``: closing the generator early closes the decode
        connection, which makes the engine abort the request. Options: ``stream`` (required),
        ``deadline``, ``endpoint``, ``max_age_s``, ``headers``, ``sink`` (:class:`DecodeOptions`).

        With ``sink`` (streams only), spans after the first token that cannot end the stream
        are handed to ``sink`` from the connection's data callback instead of being yielded
        (:mod:`narwhal.engines.relay`); the generator then also yields ``b""`` when ``sink``
        reported the client behind: wait for the client to drain, then go on iterating.
        """
        max_age_s = options.get("max_age_s")
        descriptor = checked_handoff(result, options.get("endpoint") or result.endpoint, max_age_s)
        leg = self.decode_leg(result, consumer, body, descriptor, **options)
        try:
            whole = await leg.open()
            if whole is not None:
                yield whole
                return
            while (span := await leg.next_span()) is not Signal.END:
                # The generator's documented form (README): b"" says the client fell behind.
                yield b"" if span is Signal.BEHIND else span
        finally:
            leg.close()

    async def release(
        self,
        result: PrefillResult,
        consumer: EngineRef,
        body: dict[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        max_age_s: float | None = None,
    ) -> ReleaseOutcome:
        """Hand an undecoded descriptor to ``consumer`` as a one-token decode, so vLLM frees
        the producer's KV blocks now instead of at its lease or abort timeout.

        Bounded by ``first_token_timeout_s``; the answer is discarded. The descriptor is sent as it
        is: a caller on the request path validates it first. With ``max_age_s`` (docs/behaviour.md
        "Cleanup", docs/decisions.md "vLLM releases"), only a handoff younger than
        that is sent, and its request must be on its way before that age: a later read could take
        blocks the producer already gave to another request. See :data:`ReleaseOutcome`.
        """
        if result.descriptor is None:
            return "failed"
        now = asyncio.get_running_loop().time()
        seconds = self.settings.first_token_timeout_s
        bound = failures.leg_bound(now, seconds, None)
        if max_age_s is not None:
            left = max_age_s - result.age()
            if left <= 0:
                return "expired"
            bound = min(bound, now + left)  # the request must reach the consumer within the lease
        payload = orjson.dumps(result.endpoint.dialect.release_body(body, result.request_id, result.descriptor))
        head = self.engine_headers(result.request_id, headers)
        # What a release makes of a wire failure is where it happened, not its reason.
        wire = failures.WireFailures(consumer.name, "decode", None, Wait.FIRST_TOKEN, seconds, bound)
        try:
            with wire:
                conn = await self.pool.post(consumer.url, result.endpoint.path, head, payload, deadline=bound)
        except EngineError:
            return "unreachable"  # nothing went out: the consumer never saw the handoff
        try:
            with wire:
                status, _ = await _answer(conn)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, EngineError):
                return "failed"
            raise
        return "released" if status == 200 else "failed"


    async def passthrough(
        self,
        engine: EngineRef,
        path: str,
        body: dict[str, Any],
        *,
        request_id: str,
        phase: Phase,
        deadline: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes, str]:
        """POST ``body`` to ``path`` on ``engine`` (``/tokenize``, ``/v1/embeddings`` …,
        docs/behaviour.md "The other P/D endpoints") and return its 2xx answer: status, body and
        content type, to relay as they are.

        One request, no descriptor, bounded by ``first_token_timeout_s`` and ``deadline`` (loop
        time): the engine owes an answer as it owes a first token. ``phase`` is the role the
        engine serves in (its breaker streak). A cancelled caller closes the connection, so the
        engine drops the request. Every other outcome raises, as on the legs.
        """
        seconds = self.settings.first_token_timeout_s
        bound = failures.leg_bound(asyncio.get_running_loop().time(), seconds, deadline)
        payload = orjson.dumps(body)
        head = self.engine_headers(request_id, headers)
        with failures.WireFailures(engine.name, phase, deadline, Wait.ANSWER, seconds, bound):
            conn = await self.pool.post(engine.url, path, head, payload, deadline=bound)
            try:
                status = await conn.response()
                content_type = conn.header("content-type") or "application/json"
                data = await conn.read_all()
            except BaseException:
                conn.close()
                raise
            conn.release()
        if not 200 <= status < 300:
            raise failures.status_error(status, data, engine.name, phase)
        return status, data, content_type


async def _answer(conn: Connection) -> tuple[int, bytes]:
    """The status and whole body of the answer on ``conn``, which then goes back to the pool."""
    status = await conn.response()
    data = await conn.read_all()
    conn.release()
    return status, data


def _prefill_result(result: PrefillResult, status: int, data: bytes) -> PrefillResult:
    if status != 200:
        raise failures.status_error(status, data, result.producer, "prefill")
    # A 200 may still report the engine's own failure (a Response with "status": "failed"): that
    # is the engine's error, mapped as an in-stream one, not a descriptor the producer got wrong.
    dialect = result.endpoint.dialect
    if (err := dialect.whole_error(data)) is not None:
        raise failures.stream_error(err, result.producer, "prefill")
    result.finished_at = time.monotonic()
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        answer = None
    if type(answer) is not dict:  # decoded JSON: an object is exactly a dict
        return result
    if result.crossed:
        result.descriptor = answer.get("kv_transfer_params")
    # Each endpoint reports the prompt's cached part in its own usage field.
    usage = dialect.prompt_usage(answer.get("usage"))
    result.prompt_tokens, result.cached_tokens = usage
    if type(result.descriptor) is dict:  # vLLM 0.33 says it in the handoff too (docs/decisions.md "vLLM releases")
        _from_descriptor(result, result.descriptor)
    return result


def _from_descriptor(result: PrefillResult, descriptor: dict[str, Any]) -> None:
    """The producer's cache hits (``remote_prefill_cached_tokens``, whenever present) and the
    prompt's tokens (``remote_num_tokens``, where usage said none) from a 0.33 descriptor: a
    holdings source without ``--enable-prompt-tokens-details`` (docs/decisions.md "vLLM releases",
    "Placement" source 2). Not a whole number in range: unknown, the usage's word stands."""
    cached = token_count(descriptor.get("remote_prefill_cached_tokens"))
    if cached is not None:
        result.cached_tokens = cached
    if result.prompt_tokens is None:
        result.prompt_tokens = token_count(descriptor.get("remote_num_tokens"))
