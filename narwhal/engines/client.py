"""HTTP to vLLM engines: the prefill leg, the decode stream and handoff release.

This is the one place where transport errors, HTTP statuses and the stream rules of SPEC §4
become :class:`EngineError` reasons. The wire itself is :mod:`narwhal.engines.http1`, a lean
pooled HTTP/1.1 client (see there why not aiohttp's client on this path).

Timeouts are deadlines computed here (loop time) and enforced by the connection, one timer
per exchange, so "the first token within N seconds" covers connect and response headers too
(SPEC §4); after the headers each relay read has its own bound, so no total timeout ever ends
a long generation. No timeout context ever spans a ``yield``: a timer that fired while the
caller was writing to a slow client would cancel the caller, not this generator.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

import orjson

from narwhal.engines import sse
from narwhal.engines.connector import (
    PrefillResult,
    decode_body,
    prefill_body,
    release_body,
    validate_descriptor,
)
from narwhal.engines.control import EngineRef, auth_line, ssl_context
from narwhal.engines.http1 import ConnectFailed, Connection, UpstreamError, UpstreamPool, header_lines
from narwhal.engines.relay import DirectRelay, Sink
from narwhal.engines.timers import LazyTimeout
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError, Phase
from narwhal.settings import EngineSettings

_DRAIN_S = 1.0
# The direct relay has a fixed cost per stream (a timer, a wakeup for the end). The span after
# the first token still takes the generator path: in an unpaced stream it usually holds the
# whole rest and [DONE], which that path writes with the end of the body at no extra cost.
# Measured (A/B, perf suite): 1 beats 3 by ~5 % unpaced and 5-11 % paced; 0 costs ~10 % unpaced.
_RELAY_AFTER = 1


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
        self._auth = auth_line(settings)  # the one engine header (engines.control), prebuilt

    @classmethod
    def for_settings(cls, settings: EngineSettings) -> EngineClient:
        """A client with its own pool, verifying ``https://`` engines as every caller does."""
        return cls(UpstreamPool(ssl_context(settings.ca_file)), settings)

    async def close(self) -> None:
        await self.pool.close()

    def _headers(self, request_id: str, extra: Mapping[str, str] | None) -> bytes:
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
        endpoint: str,
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
        loop = asyncio.get_running_loop()
        result = PrefillResult(
            producer=producer.name,
            producer_url=producer.url,
            endpoint=endpoint,
            request_id=request_id,
            descriptor=None,
            crossed=crossed,
        )
        limit = loop.time() + self.settings.prefill_timeout_s
        bound = limit if deadline is None else min(limit, deadline)
        payload = orjson.dumps(prefill_body(body, crossed=crossed))
        on_rest = None
        if on_abandon is not None:
            abandon = on_abandon

            def on_rest(rest: Awaitable[tuple[int, bytes]]) -> None:
                abandon(self._finish_prefill(rest, result))

        try:
            status, data = await self._exchange(
                producer.url, endpoint, self._headers(request_id, headers), payload, bound, on_rest
            )
        except TimeoutError:
            if deadline is not None and bound == deadline:
                raise DeadlineExceeded("the request deadline ran out during prefill") from None
            raise EngineError(
                f"prefill on engine {producer.name} exceeded {self.settings.prefill_timeout_s:g}s",
                reason="prefill_timeout",
                engine=producer.name,
                phase="prefill",
            ) from None
        except UpstreamError as exc:
            raise _transport_error(exc, producer.name, "prefill") from None
        return _prefill_result(result, status, data)

    @staticmethod
    async def _finish_prefill(rest: Awaitable[tuple[int, bytes]], result: PrefillResult) -> PrefillResult:
        status, data = await rest
        return _prefill_result(result, status, data)

    async def decode(
        self,
        result: PrefillResult,
        consumer: EngineRef,
        body: dict[str, Any],
        *,
        stream: bool,
        deadline: float | None = None,
        endpoint: str | None = None,
        max_age_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        sink: Sink | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Validate the handoff, then decode on ``consumer`` and yield the response bytes.

        Use it under ``contextlib.aclosing``: closing the generator early closes the decode
        connection, which makes the engine abort the request.

        With ``sink`` (streams only), spans after the first token that cannot end the stream
        are handed to ``sink`` from the connection's data callback instead of being yielded
        (:mod:`narwhal.engines.relay`); the generator then also yields ``b""`` when ``sink``
        reported the client behind: wait for the client to drain, then go on iterating.
        """
        endpoint = endpoint or result.endpoint
        descriptor = None
        if result.crossed:
            descriptor = validate_descriptor(
                result.descriptor,
                producer=result.producer,
                prefill_endpoint=result.endpoint,
                decode_endpoint=endpoint,
            )
        if max_age_s is not None and result.age() > max_age_s:
            raise _expired(result, max_age_s)
        payload = orjson.dumps(decode_body(body, descriptor))
        loop = asyncio.get_running_loop()
        if stream:
            first = loop.time() + self.settings.first_token_timeout_s
            first_bound = first if deadline is None else min(first, deadline)
        else:
            first_bound = deadline if deadline is not None else math.inf
        name = consumer.name
        conn: Connection | None = None
        finished = False
        try:
            try:
                conn = await self.pool.post(
                    consumer.url, endpoint, self._headers(result.request_id, headers), payload, deadline=first_bound
                )
                status = await conn.response()
                if status != 200:
                    raise _status_error(status, await conn.read_all(), name, "decode")
                if not stream:
                    data = await conn.read_all()
                conn.disarm()  # the relay bounds each read itself
            except TimeoutError:
                raise self._timeout(name, first_bound, deadline, before_token=True) from None
            except UpstreamError as exc:
                raise _transport_error(exc, name, "decode") from None
            if not stream:
                finished = True
                yield data
                return
            # The relay. After the first token, a span that cannot hold [DONE] or an error
            # is passed through untouched: the hot path is one framer call and one yield.
            read_timeout = self.settings.decode_read_timeout_s
            framer = sse.SSEFramer()
            held: list[bytes] = []  # metadata before the first token, sent along with it
            seen_token = False
            done = False
            timer = LazyTimeout()
            relay: DirectRelay | None = None  # built when first needed: short streams never are
            passed = 0  # spans yielded after the first token
            try:
                while not done:
                    span: bytes | None = None
                    if sink is not None and seen_token and passed >= _RELAY_AFTER:
                        if relay is None:
                            relay = DirectRelay(conn, framer, sink, read_timeout, deadline)
                        try:
                            span = await relay.run()
                        except TimeoutError:
                            bound = relay.timed_out_at or math.inf
                            raise self._timeout(name, bound, deadline, before_token=False) from None
                        if span == b"":
                            yield b""  # the client fell behind: the caller lets it drain
                            continue
                    if span is None:  # before the first token, or the relay saw the engine end
                        if not seen_token:
                            bound = first_bound
                        elif read_timeout:
                            bound = loop.time() + read_timeout
                            if deadline is not None and deadline < bound:
                                bound = deadline
                        else:
                            bound = deadline if deadline is not None else math.inf
                        try:
                            chunk = await timer.wait(conn.read_some(), bound)
                        except TimeoutError:
                            raise self._timeout(name, bound, deadline, before_token=not seen_token) from None
                        except UpstreamError:
                            chunk = b""
                        if not chunk:
                            raise EngineError(
                                f"engine {name} closed the stream before [DONE]",
                                reason="engine_disconnect",
                                engine=name,
                                phase="decode",
                            )
                        span = framer.feed(chunk)
                        if not span:
                            continue
                    if seen_token and not sse.may_end_stream(span):
                        passed += 1
                        yield span
                        continue
                    out = held
                    if seen_token and sse.ends_with_done(span):
                        # The usual end: tokens, [DONE] last, no error object: as received.
                        out.append(span)
                        done = True
                    for event in () if done else sse.split_events(span):
                        if seen_token and not sse.may_end_stream(event):
                            out.append(event + b"\n\n")  # after the first token only the end matters
                            continue
                        kind, err = sse.classify(event)
                        if kind is sse.Kind.TOKEN:
                            seen_token = True
                        elif kind is sse.Kind.DONE:
                            if not seen_token:
                                raise EngineError(
                                    "stream ended with [DONE] before any token arrived",
                                    reason="done_before_token",
                                    engine=name,
                                    phase="decode",
                                )
                            out.append(sse.DONE_EVENT)
                            done = True
                            break
                        elif kind is sse.Kind.ERROR:
                            if seen_token and out:
                                yield b"".join(out)
                            raise _stream_error(err or {}, name)
                        out.append(event + b"\n\n")
                    if done:
                        # Read the end of the chunked body (normally here already) *before* the
                        # last span goes out: the caller ends the client's response with it, and
                        # a client that has its whole answer may leave at once; nothing may wait
                        # after that. A body that ends cleanly lets the connection be pooled.
                        finished = conn.complete or await self._read_to_end(conn)
                    if seen_token:
                        held = []
                        yield out[0] if len(out) == 1 else b"".join(out)
            finally:
                timer.close()
        finally:
            if conn is not None:
                if finished:
                    conn.release()
                else:
                    conn.close()

    @staticmethod
    async def _read_to_end(conn: Connection) -> bool:
        try:
            async with asyncio.timeout(_DRAIN_S):
                await conn.read_all()
        except (TimeoutError, UpstreamError):
            return False
        return True

    def _timeout(self, name: str, bound: float, deadline: float | None, *, before_token: bool) -> Exception:
        if deadline is not None and bound >= deadline:
            return DeadlineExceeded("the request deadline ran out while decoding")
        if before_token:
            return EngineError(
                f"engine {name} sent no token within {self.settings.first_token_timeout_s:g}s",
                reason="first_token_timeout",
                engine=name,
                phase="decode",
            )
        return EngineError(
            f"engine went silent between tokens: engine {name} sent nothing for "
            f"{self.settings.decode_read_timeout_s:g}s",
            reason="decode_silence",
            engine=name,
            phase="decode",
        )

    async def release(
        self,
        result: PrefillResult,
        consumer: EngineRef,
        body: dict[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        """Hand an undecoded descriptor to ``consumer`` as a one-token decode, so vLLM frees
        the producer's KV blocks now instead of at its lease or abort timeout.

        Bounded by ``first_token_timeout_s``; the answer is discarded. True when it was taken.
        """
        if result.descriptor is None:
            return False
        payload = orjson.dumps(release_body(body, result.descriptor))
        bound = asyncio.get_running_loop().time() + self.settings.first_token_timeout_s
        try:
            status, _ = await self._exchange(
                consumer.url, result.endpoint, self._headers(result.request_id, headers), payload, bound
            )
        except (TimeoutError, UpstreamError):
            return False
        return status == 200


async def _answer(conn: Connection) -> tuple[int, bytes]:
    """The status and whole body of the answer on ``conn``, which then goes back to the pool."""
    status = await conn.response()
    data = await conn.read_all()
    conn.release()
    return status, data


def _prefill_result(result: PrefillResult, status: int, data: bytes) -> PrefillResult:
    if status != 200:
        raise _status_error(status, data, result.producer, "prefill")
    result.finished_at = time.monotonic()
    if result.crossed:
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            answer = None
        result.descriptor = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return result


def _transport_error(exc: UpstreamError, name: str, phase: Phase) -> EngineError:
    if isinstance(exc, ConnectFailed):
        message = f"engine {name} is unreachable ({phase})"
    else:
        message = f"engine {name} closed the connection before a response ({phase})"
    return EngineError(message, reason="engine_unreachable", engine=name, phase=phase)


def _engine_message(data: bytes) -> str:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:500].decode("utf-8", "replace").strip()
    if isinstance(obj, dict):
        err = sse.error_object(obj)
        message = err.get("message") if err is not None else None
        if isinstance(message, str):
            return message
        detail = obj.get("detail")  # FastAPI's own 4xx form
        if isinstance(detail, str):
            return detail
    return ""


def _status_error(status: int, data: bytes, name: str, phase: Phase) -> EngineError:
    if 400 <= status < 500:
        message = _engine_message(data) or f"engine {name} answered HTTP {status}"
        return EngineClientError(message, engine=name, phase=phase, status=status)
    return EngineError(
        f"engine {name} answered HTTP {status} ({phase})", reason="engine_5xx", engine=name, phase=phase
    )


def _stream_error(err: dict[str, Any], name: str) -> EngineError:
    code = err.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else 502
    message = err.get("message")
    if not isinstance(message, str) or not message:
        message = f"engine {name} reported an error inside the stream"
    error = EngineError(message, reason="engine_stream_error", engine=name, phase="decode", status=status)
    error.counts = status >= 500
    return error


def _expired(result: PrefillResult, max_age_s: float) -> EngineError:
    error = EngineError(
        f"handoff from engine {result.producer} expired after {result.age():.1f}s "
        f"(handoff.max_age_s = {max_age_s:g})",
        reason="handoff_expired",
        engine=result.producer,
        phase="prefill",
    )
    error.counts = False  # nobody's fault: a slow queue, not a broken engine
    return error
