"""The request path of SPEC §3: place, prefill, validate, decode, relay, clean up.

One client request owns everything it starts: both phase reservations, the handoff, the
upstream connections and the background release of a handoff nobody will decode. Whatever
way the request ends — success, engine fault, deadline, client disconnect — ``finally``
blocks give each of those back exactly once.

HTTP 200 is committed only when the first generated token is in hand, so every failure
before it is still an ordinary HTTP error; after it, a failure becomes one terminal SSE
error event and the stream ends without ``[DONE]``.

Client disconnects: the app runs with ``handler_cancellation=True`` (also under gunicorn,
see ``narwhal.front.app``), so a client that goes away cancels this handler; closing the decode
generator then closes the upstream connection and the engine aborts the request. A client
that leaves during the prefill does not cancel the prefill: it finishes in the background
and its handoff is released, so the producer's KV blocks are not pinned until their lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from narwhal import metrics
from narwhal.engines import sse
from narwhal.engines.client import EngineClient
from narwhal.engines.connector import PrefillResult
from narwhal.engines.timers import LazyTimeout
from narwhal.errors import EngineError, NarwhalError
from narwhal.fleet import Fleet
from narwhal.fleet.placement import Placement, Reservation
from narwhal.reasons import retryable
from narwhal.request.accesslog import AccessLog, AccessRecord
from narwhal.request.admission import ClientRequest, admit
from narwhal.request.outcomes import Outcomes
from narwhal.settings import Settings

log = logging.getLogger("narwhal.request.router")

# Copied per stream: cheaper than building the header set from a dict each time.
SSE_HEADERS = CIMultiDict({"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
# A write of at most this many bytes into an empty transport buffer can not pause it (the
# high-water mark is 64 KiB, never lowered here), so aiohttp's write returns without waiting.
_UNBLOCKED_WRITE = 16 * 1024
_MAX_REQUEST_ID = 128


class _SSEResponse(web.StreamResponse):
    # Headers go out in the same write as the first token (one syscall, one client wakeup)
    # instead of on their own: prepare() is only called once that token is in hand anyway.
    _send_headers_immediately = False


class _ClientSink:
    """Writes relayed spans (``narwhal.engines.relay``) straight to the client's transport,
    framed as aiohttp frames the rest of the response (chunked on HTTP/1.1). Used only after
    the first token went out through aiohttp, so headers and ordering are already settled."""

    __slots__ = ("_transport", "_chunked", "_high")

    def __init__(self, request: web.Request) -> None:
        self._transport = request.transport
        self._chunked = True
        self._high = 0

    def start(self, stream: web.StreamResponse) -> None:
        self._chunked = stream.headers.get("Transfer-Encoding", "").lower() == "chunked"
        if self._transport is not None:
            self._high = self._transport.get_write_buffer_limits()[1]

    def __call__(self, span: bytes) -> bool:
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        try:
            transport.write(b"%x\r\n%b\r\n" % (len(span), span) if self._chunked else span)
        except (OSError, RuntimeError):  # raised inside the engine's data callback: never let it out
            return False
        return transport.get_write_buffer_size() <= self._high


def _cannot_wait(request: web.Request, size: int) -> bool:
    """Would writing ``size`` bytes to this client return at once? Then no write timer is armed."""
    transport = request.transport
    return transport is not None and size <= _UNBLOCKED_WRITE and not transport.get_write_buffer_size()


async def _prepare_and_end(response: web.Response, request: web.Request) -> None:
    await response.prepare(request)
    await response.write_eof()


def _observe_start(rec: AccessRecord, handoff_age: float) -> None:
    # Observed once the first output is on its way to the client (or the attempt ended), not
    # on the way to it: the histograms' timing does not matter, the first token's does.
    if rec.ttft_s is not None:
        metrics.TTFT.observe(rec.ttft_s)
    metrics.HANDOFF_AGE.observe(handoff_age)
    if rec.first_byte_s is not None:
        metrics.FIRST_BYTE.observe(rec.first_byte_s)


class WorkerState(Protocol):
    """The request-level part of the fleet state (local or shared memory)."""

    def request_started(self) -> None: ...
    def request_finished(self) -> None: ...
    def try_start_retry(self, ratio: float, minimum: int) -> bool: ...
    def retry_finished(self) -> None: ...


_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """A unique id (32 hex digits, like a uuid4's): a random per-process prefix and a counter,
    which is far cheaper than ``uuid4()`` on the per-request path. Forked workers re-seed."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def _reseed_ids() -> None:
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX = os.urandom(8).hex()
    _ID_COUNTER = itertools.count()


os.register_at_fork(after_in_child=_reseed_ids)


def client_request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id")
    if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
        return given
    return new_id()


def error_response(exc: NarwhalError, request_id: str) -> web.Response:
    headers = exc.headers()
    headers["x-request-id"] = request_id
    return web.Response(status=exc.status, body=exc.body(), content_type="application/json", headers=headers)


class Router:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        placement: Placement,
        client: EngineClient,
        outcomes: Outcomes,
        state: WorkerState,
        access_log: AccessLog,
    ) -> None:
        self.settings = settings
        self.recovery = settings.recovery
        self.fleet = fleet
        self.placement = placement
        self.client = client
        self.outcomes = outcomes
        self.state = state
        self.access_log = access_log
        self._background: set[asyncio.Task[Any]] = set()
        self._active: set[asyncio.Task[Any] | None] = set()  # client requests being handled
        self._stopping = False
        self._drain_timer: asyncio.Future[None] | None = None

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        # Deadlines are in loop time (timers); measurements use perf_counter, because
        # uvloop's clock moves in whole milliseconds and ttft_s is often below one.
        arrival = asyncio.get_running_loop().time()
        started = time.perf_counter()
        rec = AccessRecord(request_id=client_request_id(request), endpoint=endpoint)
        task = asyncio.current_task()
        self._active.add(task)
        try:
            req = await admit(request, endpoint, self.settings, self.fleet, arrival)
            rec.model, rec.stream = req.model, req.stream
            response = await self._serve(request, req, rec, started)
            rec.status = response.status
            return response
        except NarwhalError as exc:
            return await self._fail(request, rec, exc)
        except (asyncio.CancelledError, ConnectionError) as exc:
            if isinstance(exc, asyncio.CancelledError) and self._stopping and task is not None:
                # The graceful timeout ran out: end the stream properly rather than cut it.
                task.uncancel()
                stop = NarwhalError("the router is shutting down", reason="shutting_down")
                return await self._fail(request, rec, stop)
            # 499: nginx's "client closed request", for the access log and metrics only.
            rec.status, rec.reason = 499, "client_disconnect"
            metrics.CLIENT_DISCONNECTS.inc()
            if rec.first_byte_s is not None:
                metrics.STREAM_ABORTED.labels("client_disconnect").inc()
            if isinstance(exc, asyncio.CancelledError):
                raise
            stream = request.get("narwhal.stream")
            return stream if isinstance(stream, web.StreamResponse) else web.Response(status=499)
        finally:
            self._active.discard(task)
            rec.total_s = time.perf_counter() - started
            metrics.requests_child(endpoint, rec.status).inc()
            self.access_log.write(rec)

    async def _fail(self, request: web.Request, rec: AccessRecord, exc: NarwhalError) -> web.StreamResponse:
        rec.reason = exc.reason
        stream = request.get("narwhal.stream")
        if rec.first_byte_s is None or not isinstance(stream, web.StreamResponse):
            rec.status = exc.status
            return error_response(exc, rec.request_id)
        # The 200 is already on the wire: end the stream with one terminal error event.
        rec.status = 200
        metrics.STREAM_ABORTED.labels(exc.reason).inc()
        with contextlib.suppress(ConnectionError):
            await stream.write(exc.sse_event())
            await stream.write_eof()
        return stream

    def begin_drain(self, grace_s: float) -> None:
        """SIGTERM: in-flight requests may finish for ``grace_s``; then the rest are ended
        with the terminal ``shutting_down`` event (or a 503 before their first token)."""

        async def expire() -> None:
            await asyncio.sleep(grace_s)
            self._stopping = True
            for task in list(self._active):
                if task is not None:
                    task.cancel()

        self._drain_timer = asyncio.ensure_future(expire())

    async def _serve(
        self, request: web.Request, req: ClientRequest, rec: AccessRecord, started: float
    ) -> web.StreamResponse:
        """Attempts until one succeeds or a failure may not be retried (SPEC §5)."""
        state = self.state
        avoid: set[str] = set()
        retrying = False
        state.request_started()
        try:
            while True:
                rec.attempts += 1
                try:
                    return await self._attempt(request, req, rec, started, frozenset(avoid))
                except EngineError as exc:
                    if not self._retryable(exc, req, rec):
                        raise
                    if not retrying:
                        if not state.try_start_retry(self.recovery.retry_budget_ratio, self.recovery.retry_budget_min):
                            metrics.RETRY_BUDGET_EXHAUSTED.inc()
                            raise
                        retrying = True
                    metrics.RETRIES.inc()
                    avoid.add(exc.engine)
                    if exc.phase == "decode" and rec.producer != rec.consumer and rec.producer:
                        avoid.add(rec.producer)  # a pre-token crossed fault may be the producer's
        finally:
            if retrying:
                state.retry_finished()
            state.request_finished()

    def _retryable(self, exc: EngineError, req: ClientRequest, rec: AccessRecord) -> bool:
        if rec.attempts > self.recovery.max_retries or rec.first_byte_s is not None:
            return False
        return retryable(exc.reason, exc.status) and asyncio.get_running_loop().time() < req.deadline

    async def _attempt(
        self, request: web.Request, req: ClientRequest, rec: AccessRecord, started: float, avoid: frozenset[str]
    ) -> web.StreamResponse:
        resv = await self.placement.reserve(req.model, req.deadline, avoid)
        producer, consumer = resv.producer, resv.consumer
        rec.producer, rec.consumer = producer.name, consumer.name
        try:
            result = await self._prefill(req, resv)
            resv.release_prefill()
            rec.ttft_s = time.perf_counter() - started
            response = await self._decode(request, req, resv, result, rec, started)
            metrics.attempts_child("success").inc()
            self.outcomes.success(producer, consumer)
            return response
        except EngineError as exc:
            metrics.attempts_child(exc.reason).inc()
            self.outcomes.failure(producer, consumer, exc, before_first_token=rec.first_byte_s is None)
            raise
        except NarwhalError as exc:
            metrics.attempts_child(exc.reason).inc()
            raise
        finally:
            if not resv.detached:
                resv.release()

    async def _prefill(self, req: ClientRequest, resv: Reservation) -> PrefillResult:
        def abandon(rest: Awaitable[PrefillResult]) -> None:
            # The client left mid-prefill. Let the prefill finish and release its handoff in
            # the background, which now owns the reservation.
            resv.detached = True
            self._spawn(self._finish_abandoned_prefill(rest, req, resv))

        return await self.client.prefill(
            resv.producer,
            req.endpoint,
            req.body,
            request_id=new_id(),
            crossed=resv.crossed,
            deadline=req.deadline,
            headers=req.forward,
            on_abandon=abandon,
        )

    async def _decode(
        self,
        request: web.Request,
        req: ClientRequest,
        resv: Reservation,
        result: PrefillResult,
        rec: AccessRecord,
        started: float,
    ) -> web.StreamResponse:
        stream: web.StreamResponse | None = None
        writes: LazyTimeout | None = None
        sent = False  # did the consumer receive the handoff?
        sink = _ClientSink(request) if req.stream else None
        age = result.age()
        observed = False
        try:
            chunks = self.client.decode(
                result,
                resv.consumer,
                req.body,
                stream=req.stream,
                deadline=req.deadline,
                max_age_s=self.settings.handoff.max_age_s,
                headers=req.forward,
                sink=sink,
            )
            async with contextlib.aclosing(chunks):
                async for data in chunks:
                    if stream is None:
                        sent = True
                        rec.first_byte_s = time.perf_counter() - started
                        if not req.stream:
                            # Written here rather than by aiohttp after the handler returns,
                            # so the client has it before the bookkeeping, not after.
                            response = web.Response(
                                body=data,
                                content_type="application/json",
                                headers={"x-request-id": rec.request_id},
                            )
                            await self._send_whole(request, response, len(data))
                            return response
                        stream = _SSEResponse(headers=SSE_HEADERS)
                        stream.headers["x-request-id"] = rec.request_id
                        request["narwhal.stream"] = stream
                        await stream.prepare(request)
                        assert sink is not None
                        sink.start(stream)
                        writes = LazyTimeout()
                    assert writes is not None
                    if not data:  # the relay found the client behind: let it drain
                        await self._drain(request, writes)
                        continue
                    # The span with [DONE] goes out with the end of the chunked body: one
                    # write, one client wakeup, instead of a separate 5-byte terminator.
                    await self._write(stream, request, data, writes, eof=data.endswith(sse.DONE_EVENT))
                    if not observed:
                        observed = True
                        _observe_start(rec, age)
            if stream is None or writes is None:  # pragma: no cover - decode always yields or raises
                raise EngineError("empty decode response", reason="engine_disconnect",
                                  engine=resv.consumer.name, phase="decode")
            await self._write(stream, request, b"", writes, eof=True)  # no-op after [DONE]
            return stream
        except EngineError as exc:
            if exc.reason == "invalid_handoff":
                metrics.HANDOFFS_ABANDONED.inc()  # sent nowhere: no consumer could use it
            elif exc.reason == "handoff_expired":
                self._release_later(result, req, resv)
            raise
        except (asyncio.CancelledError, ConnectionError):
            if not sent and result.descriptor is not None and rec.first_byte_s is None:
                # Gone before the consumer answered: it may never have queued the request.
                self._release_later(result, req, resv)
            raise
        finally:
            if not observed:
                _observe_start(rec, age)

    async def _write(
        self, stream: web.StreamResponse, request: web.Request, data: bytes, writes: LazyTimeout, eof: bool = False
    ) -> None:
        """Write to the client; one that does not read for ``client_write_timeout_s`` is dropped
        (its buffer stops growing and the engine stream is closed, like any departed client)."""
        if _cannot_wait(request, len(data)):
            # The usual case, the first token's included: nothing to bound.
            await (stream.write_eof(data) if eof else stream.write(data))
            return
        await self._bounded(request, writes, stream.write_eof(data) if eof else stream.write(data))

    async def _send_whole(self, request: web.Request, response: web.Response, size: int) -> None:
        # Under the same write bound as a stream: a client that does not read its answer must
        # not keep this request (and its reservations) alive.
        if _cannot_wait(request, size):
            await _prepare_and_end(response, request)
            return
        writes = LazyTimeout()
        try:
            await self._bounded(request, writes, _prepare_and_end(response, request))
        finally:
            writes.close()

    async def _drain(self, request: web.Request, writes: LazyTimeout) -> None:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client went away")
        await self._bounded(request, writes, request.writer.drain())

    async def _bounded(self, request: web.Request, writes: LazyTimeout, client_io: Awaitable[None]) -> None:
        bound = asyncio.get_running_loop().time() + self.settings.server.client_write_timeout_s
        try:
            await writes.wait(client_io, bound)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client stopped reading its stream") from None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release_later(self, result: PrefillResult, req: ClientRequest, resv: Reservation) -> None:
        if result.descriptor is not None and result.crossed:
            self._spawn(self._release(result, req, resv.consumer))

    async def _release(self, result: PrefillResult, req: ClientRequest, consumer: Any) -> None:
        if await self.client.release(result, consumer, req.body, headers=req.forward):
            metrics.HANDOFFS_RELEASED.inc()
        else:
            metrics.HANDOFFS_ABANDONED.inc()

    async def _finish_abandoned_prefill(
        self, task: Awaitable[PrefillResult], req: ClientRequest, resv: Reservation
    ) -> None:
        try:
            result = await task
            resv.release_prefill()
            if result.crossed:
                await self._release(result, req, resv.consumer)
        except Exception:
            pass  # the prefill failed: there is no handoff to free
        finally:
            resv.release()

    async def drain_background(self, timeout: float) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()  # every request is done: nothing left to end
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)
