"""HTTP to vLLM engines: the prefill leg, the decode stream and handoff release.

This is the only module that touches aiohttp's client, and the one place where transport
errors, HTTP statuses and the stream rules of SPEC §4 become :class:`EngineError` reasons.

Timeouts are deadlines computed here with ``asyncio.timeout_at`` rather than aiohttp's
``ClientTimeout``: aiohttp's ``total`` would end any generation longer than it, and its
``sock_read`` runs from the first byte of the response, so it cannot express "the first token
within N seconds *including* connect and response headers" (SPEC §4). No timeout context ever
spans a ``yield``: a timer that fired while the caller was writing to a slow client would
cancel the caller, not this generator.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, Protocol

import aiohttp
import orjson

from narwhal import sse
from narwhal.engines.connector import (
    PrefillResult,
    decode_body,
    prefill_body,
    release_body,
    validate_descriptor,
)
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError, Phase
from narwhal.settings import EngineSettings
from narwhal.timeouts import LazyTimeout

_JSON = "application/json"
_DRAIN_S = 1.0


class EngineRef(Protocol):
    """Anything with a ``name`` and a base ``url`` (a fleet Engine, an EngineSpec …)."""

    name: str
    url: str


_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ClientSSLError)
_TRANSPORT_ERRORS = (aiohttp.ClientError, ConnectionError, OSError)


class EngineClient:
    """Prefill, decode and release against vLLM engines over one pooled session.

    ``prefill(...) -> PrefillResult``; pass the result unchanged to ``decode(...)``, an async
    generator of response bytes: for a stream, spans of whole SSE events as received (the
    first span holds the first generated token, with any metadata before it); for a
    non-streaming request, the whole body once. Every failure raises an ``EngineError``.
    """

    def __init__(self, session: aiohttp.ClientSession, settings: EngineSettings) -> None:
        self._session = session
        self.settings = settings
        self._auth = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}

    def _headers(self, request_id: str, extra: Mapping[str, str] | None) -> dict[str, str]:
        headers = {"Content-Type": _JSON, "X-Request-Id": request_id, **self._auth}
        if extra:
            headers.update(extra)
        return headers

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
    ) -> PrefillResult:
        """Run the prefill leg on ``producer``; bounded by ``prefill_timeout_s`` and ``deadline``.

        ``deadline`` is in ``loop.time()`` units. ``crossed=False`` (same-worker decode) sends
        no ``kv_transfer_params`` and returns a result without a descriptor.
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
        try:
            async with asyncio.timeout_at(bound):
                async with self._session.post(
                    producer.url + endpoint, data=payload, headers=self._headers(request_id, headers)
                ) as resp:
                    data = await resp.read()
                    status = resp.status
        except TimeoutError:
            if deadline is not None and bound == deadline:
                raise DeadlineExceeded("the request deadline ran out during prefill") from None
            raise EngineError(
                f"prefill on engine {producer.name} exceeded {self.settings.prefill_timeout_s:g}s",
                reason="prefill_timeout",
                engine=producer.name,
                phase="prefill",
            ) from None
        except _TRANSPORT_ERRORS as exc:
            raise _transport_error(exc, producer.name, "prefill") from None
        if status != 200:
            raise _status_error(status, data, producer.name, "prefill")
        result.finished_at = time.monotonic()
        if crossed:
            try:
                answer = orjson.loads(data)
            except orjson.JSONDecodeError:
                answer = None
            result.descriptor = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return result

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
    ) -> AsyncGenerator[bytes, None]:
        """Validate the handoff, then decode on ``consumer`` and yield the response bytes.

        Use it under ``contextlib.aclosing``: closing the generator early closes the decode
        connection, which makes the engine abort the request.
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
            first_bound = deadline if deadline is not None else float("inf")
        name = consumer.name
        resp: aiohttp.ClientResponse | None = None
        finished = False
        try:
            try:
                async with asyncio.timeout_at(_finite(first_bound)):
                    resp = await self._session.post(
                        consumer.url + endpoint,
                        data=payload,
                        headers=self._headers(result.request_id, headers),
                    )
                    if resp.status != 200:
                        raise _status_error(resp.status, await resp.read(), name, "decode")
                    if not stream:
                        data = await resp.read()
            except TimeoutError:
                raise self._timeout(name, first_bound, deadline, before_token=True) from None
            except _TRANSPORT_ERRORS as exc:
                raise _transport_error(exc, name, "decode") from None
            if not stream:
                finished = True
                yield data
                return
            timer = LazyTimeout()
            try:
                async for span in self._relay(resp, name, first_bound, deadline, timer):
                    yield span
            finally:
                timer.close()
            # After [DONE], read the end of the chunked body (normally already here): a
            # response released before its end closes the connection instead of pooling it.
            if not resp.content.at_eof():
                try:
                    async with asyncio.timeout(_DRAIN_S):
                        await resp.read()
                except (TimeoutError, *_TRANSPORT_ERRORS):
                    return  # finally closes it
            finished = True
        finally:
            if resp is not None:
                if finished:
                    resp.release()
                else:
                    resp.close()

    async def _relay(
        self, resp: aiohttp.ClientResponse, name: str, first_bound: float, deadline: float | None, timer: LazyTimeout
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        read_timeout = self.settings.decode_read_timeout_s
        framer = sse.SSEFramer()
        held: list[bytes] = []  # metadata before the first token, sent along with it
        seen_token = False
        content = resp.content
        while True:
            if not seen_token:
                bound = first_bound
            elif read_timeout:
                bound = loop.time() + read_timeout
                if deadline is not None and deadline < bound:
                    bound = deadline
            else:
                bound = deadline if deadline is not None else math.inf
            try:
                chunk = await timer.wait(content.readany(), bound)
            except TimeoutError:
                raise self._timeout(name, bound, deadline, before_token=not seen_token) from None
            except _TRANSPORT_ERRORS:
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
                yield span  # the hot path: pass the bytes through untouched
                continue
            out: list[bytes] = held
            done = False
            for event in sse.split_events(span):
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
            if seen_token:
                held = []
                yield b"".join(out)
            if done:
                return

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
        try:
            async with asyncio.timeout(self.settings.first_token_timeout_s):
                async with self._session.post(
                    consumer.url + result.endpoint,
                    data=payload,
                    headers=self._headers(result.request_id, headers),
                ) as resp:
                    await resp.read()
                    return resp.status == 200
        except (TimeoutError, *_TRANSPORT_ERRORS):
            return False


def _finite(bound: float) -> float | None:
    return None if bound == float("inf") else bound


def _transport_error(exc: BaseException, name: str, phase: Phase) -> EngineError:
    if isinstance(exc, _CONNECT_ERRORS):
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
