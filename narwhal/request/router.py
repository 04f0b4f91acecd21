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

from narwhal import metrics
from narwhal.engines import sse
from narwhal.engines.client import EngineClient
from narwhal.engines.connector import PrefillResult
from narwhal.errors import EngineError, NarwhalError
from narwhal.fleet import Fleet
from narwhal.fleet.placement import Placement, Reservation
from narwhal.reasons import retryable
from narwhal.request.accesslog import AccessLog, AccessRecord
from narwhal.request.admission import ClientRequest, admit
from narwhal.request.client_stream import ClientStream
from narwhal.request.outcomes import Outcomes
from narwhal.settings import Settings

log = logging.getLogger("narwhal.request.router")

_MAX_REQUEST_ID = 128


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
        client = ClientStream(request, rec.request_id, self.settings.server.client_write_timeout_s)
        task = asyncio.current_task()
        self._active.add(task)
        try:
            req = await admit(request, endpoint, self.settings, self.fleet, arrival)
            rec.model, rec.stream = req.model, req.stream
            response = await self._serve(client, req, rec, started)
            rec.status = response.status
            return response
        except NarwhalError as exc:
            return await self._fail(client, rec, exc)
        except (asyncio.CancelledError, ConnectionError) as exc:
            if isinstance(exc, asyncio.CancelledError) and self._stopping and task is not None:
                # The graceful timeout ran out: end the stream properly rather than cut it.
                task.uncancel()
                stop = NarwhalError("the router is shutting down", reason="shutting_down")
                return await self._fail(client, rec, stop)
            # 499: nginx's "client closed request", for the access log and metrics only.
            rec.status, rec.reason = 499, "client_disconnect"
            metrics.CLIENT_DISCONNECTS.inc()
            if client.committed:
                metrics.STREAM_ABORTED.labels("client_disconnect").inc()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return client.stream if client.stream is not None else web.Response(status=499)
        finally:
            client.close()
            self._active.discard(task)
            rec.total_s = time.perf_counter() - started
            metrics.requests_child(endpoint, rec.status).inc()
            self.access_log.write(rec)

    async def _fail(self, client: ClientStream, rec: AccessRecord, exc: NarwhalError) -> web.StreamResponse:
        rec.reason = exc.reason
        if not client.committed or client.stream is None:
            rec.status = exc.status
            return error_response(exc, rec.request_id)
        # The 200 is already on the wire: end the stream with one terminal error event.
        rec.status = 200
        metrics.STREAM_ABORTED.labels(exc.reason).inc()
        with contextlib.suppress(ConnectionError):
            await client.fail(exc)
        return client.stream

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
        self, client: ClientStream, req: ClientRequest, rec: AccessRecord, started: float
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
                    return await self._attempt(client, req, rec, started, frozenset(avoid))
                except EngineError as exc:
                    if not self._retryable(exc, req, rec, client):
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

    def _retryable(self, exc: EngineError, req: ClientRequest, rec: AccessRecord, client: ClientStream) -> bool:
        if rec.attempts > self.recovery.max_retries or client.committed:
            return False
        return retryable(exc.reason, exc.status) and asyncio.get_running_loop().time() < req.deadline

    async def _attempt(
        self, client: ClientStream, req: ClientRequest, rec: AccessRecord, started: float, avoid: frozenset[str]
    ) -> web.StreamResponse:
        resv = await self.placement.reserve(req.model, req.deadline, avoid)
        producer, consumer = resv.producer, resv.consumer
        rec.producer, rec.consumer = producer.name, consumer.name
        try:
            result = await self._prefill(req, resv)
            resv.release_prefill()
            rec.ttft_s = time.perf_counter() - started
            response = await self._decode(client, req, resv, result, rec, started)
            metrics.attempts_child("success").inc()
            self.outcomes.success(producer, consumer)
            return response
        except EngineError as exc:
            metrics.attempts_child(exc.reason).inc()
            self.outcomes.failure(producer, consumer, exc, before_first_token=not client.committed)
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
        client: ClientStream,
        req: ClientRequest,
        resv: Reservation,
        result: PrefillResult,
        rec: AccessRecord,
        started: float,
    ) -> web.StreamResponse:
        """Decode on the consumer and relay what it sends (SPEC §3 steps 5-7)."""
        leg = None
        age = result.age()
        observed = False
        try:
            leg = self.client.decode_leg(
                result, resv.consumer, req.body, stream=req.stream, deadline=req.deadline,
                max_age_s=self.settings.handoff.max_age_s, headers=req.forward,
                sink=client.relay_sink() if req.stream else None,
            )
            whole = await leg.open()
            if whole is not None:
                rec.first_byte_s = time.perf_counter() - started
                return await client.send_whole(whole)
            while (span := await leg.next_span()) is not None:
                if not client.committed:
                    rec.first_byte_s = time.perf_counter() - started
                    await client.commit_stream()
                if not span:  # the relay found the client behind: let it drain
                    await client.drain()
                    continue
                # The span with [DONE] goes out with the end of the chunked body: one
                # write, one client wakeup, instead of a separate 5-byte terminator.
                await client.write(span, eof=span.endswith(sse.DONE_EVENT))
                if not observed:
                    observed = True
                    _observe_start(rec, age)
            assert client.stream is not None  # next_span ends only after output went out
            await client.write(b"", eof=True)  # no-op after [DONE]
            return client.stream
        except EngineError as exc:
            if exc.reason == "invalid_handoff":
                metrics.HANDOFFS_ABANDONED.inc()  # sent nowhere: no consumer could use it
            elif exc.reason == "handoff_expired":
                self._release_later(result, req, resv)
            raise
        except (asyncio.CancelledError, ConnectionError):
            if not client.committed and result.descriptor is not None:
                # Gone before the consumer answered: it may never have queued the request.
                self._release_later(result, req, resv)
            raise
        finally:
            if leg is not None:
                leg.close()
            if not observed:
                _observe_start(rec, age)

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
