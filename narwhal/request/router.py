"""One client request from admission to its last byte: the attempts, their retries, the drain.

The router admits the request (``narwhal.request.admission``), runs attempts
(``narwhal.request.attempt``) until one succeeds or a failure may not be retried (docs/behaviour.md "Recovery": a
transient fault before visible output, while the deadline and the fleet-wide retry budget
allow, avoiding the engines that just failed), and turns what is left into the client's
answer: an HTTP error before the 200 was committed, one terminal SSE error event after it
(``narwhal.request.client_stream``). Every request writes one access-log line, whatever way
it ends.

Client disconnects: the app runs with ``handler_cancellation=True`` (also under gunicorn, see
``narwhal.worker.app``), so a client that goes away cancels this handler; the attempt's
``finally`` blocks close the decode connection (the engine aborts the request) and release
what it held. ``SIGTERM``: in-flight requests may finish for the graceful time, then the rest
are ended with the ``shutting_down`` terminal event (or a 503 before their first token).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from narwhal import metrics
from narwhal.engines.client import EngineClient
from narwhal.engines.endpoints import Endpoint
from narwhal.errors import DeadlineExceeded, EngineError, NarwhalError
from narwhal.fleet import Fleet
from narwhal.reasons import retryable
from narwhal.request import client_failures
from narwhal.request.accesslog import AccessLog, AccessRecord
from narwhal.request.admission import Admission, ClientRequest
from narwhal.request.attempt import Attempts
from narwhal.request.client_stream import ClientStream
from narwhal.request.ids import client_request_id, trace_id_of
from narwhal.request.migration import Migration
from narwhal.request.outcomes import Outcomes
from narwhal.request.passthrough import Passthrough
from narwhal.request.prompt_tokens import PromptTokens
from narwhal.request.slot_wait import WaitingPlacement
from narwhal.request.stream_buffers import StreamBuffers
from narwhal.request.usage import wants_usage
from narwhal.settings import Settings

log = logging.getLogger("narwhal.request.router")



_NO_ENGINES: frozenset[str] = frozenset()


def _refused(exc: EngineError) -> bool:
    """An engine's 4xx (a status or an in-stream error's code): the request's fault, not the engine's."""
    return not exc.counts and exc.status is not None and 400 <= exc.status < 500


class WorkerState(Protocol):
    """The request-level part of the fleet state (local or shared memory)."""

    def request_started(self) -> None:
        """One more request in flight: the retry budget's base. Once per admitted request that runs attempts."""

    def request_finished(self) -> None:
        """Pairs with :meth:`request_started`, once per request however it ends."""

    def try_start_retry(self, ratio: float, minimum: int) -> bool:
        """Mark a request retrying if the fleet-wide budget allows; at most once per request."""

    def retry_finished(self) -> None:
        """Pairs with a :meth:`try_start_retry` that returned True, once, when the request ends."""

    def try_start_migration(self, ratio: float, minimum: int) -> bool:
        """Mark a stream migrating if the fleet-wide bound allows; at most once per stream."""

    def migration_finished(self) -> None:
        """Pairs with a :meth:`try_start_migration` that returned True, once, when the stream ends."""


@dataclass(frozen=True, slots=True)
class RouterParts:
    """What a worker's router is built from, by name (``narwhal.worker.compose`` builds them)."""

    settings: Settings
    fleet: Fleet
    placement: WaitingPlacement
    client: EngineClient
    outcomes: Outcomes
    state: WorkerState
    access_log: AccessLog


class Router:
    """One worker's requests: admission, attempts and retries, the HTTP error or terminal event, drain."""

    def __init__(self, parts: RouterParts) -> None:
        self.settings = settings = parts.settings
        self.recovery = settings.recovery
        self.fleet = fleet = parts.fleet
        self.placement = placement = parts.placement
        self.client = client = parts.client
        self.outcomes = outcomes = parts.outcomes
        self.state = parts.state
        self.access_log = parts.access_log
        self._background: set[asyncio.Task[Any]] = set()
        self.admission = Admission(settings, fleet, placement.policy,
                                   PromptTokens(settings.placement, placement, client))
        self.attempts = Attempts(settings, placement, client, outcomes, self._spawn)
        self.passthrough = Passthrough(settings, placement, client, outcomes)
        # What this worker's clients that are behind may hold together (request.stream_buffers).
        self.buffers = StreamBuffers(settings.server.max_buffered_mib << 20)
        client.charge_events_to(self.buffers)  # an unfinished SSE event's bytes count in the same bound
        self._active: set[asyncio.Task[Any] | None] = set()  # client requests being handled
        self._stopping = False
        self._drain_timer: asyncio.Future[None] | None = None
        # The worker's loop, taken once: asyncio.get_running_loop() costs a getpid() syscall per
        # call on CPython 3.11 (engines.timers).
        self._loop: asyncio.AbstractEventLoop | None = None

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Serve one client request on ``endpoint``; whatever way it ends, writes one access-log line."""
        # Deadlines are in loop time (timers); measurements use perf_counter, because
        # uvloop's clock moves in whole milliseconds and ttft_s is often below one.
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        arrival = loop.time()
        started = time.perf_counter()
        traceparent = request.headers.get("traceparent")  # parsed only when sent: most requests send none
        path = endpoint.path
        rec = AccessRecord(request_id=client_request_id(request), endpoint=path, client=request.remote,
                           trace_id=None if traceparent is None else trace_id_of(traceparent))
        client = ClientStream(
            request, rec.request_id, self.settings.server.client_write_timeout_s, endpoint.dialect, self.buffers
        )
        task = asyncio.current_task(loop)
        self._active.add(task)
        req: ClientRequest | None = None
        try:
            response: web.StreamResponse
            req = await self.admission.admit(request, endpoint, arrival, traceparent, rec.request_id)
            rec.model, rec.stream = req.model, req.stream
            if endpoint.passthrough:
                response = await self.passthrough.serve(req, rec, started)
            else:
                response = await self._serve(client, req, rec, started)
            rec.status = response.status
            return response
        except NarwhalError as exc:
            if isinstance(exc, DeadlineExceeded) and req is not None:  # every 504 names its bound's value
                exc = DeadlineExceeded(f"{exc.message} (the request's deadline: {round(req.deadline - arrival, 3):g}s)")
            return await client_failures.fail(client, rec, exc)
        except (asyncio.CancelledError, ConnectionError) as exc:
            if isinstance(exc, asyncio.CancelledError) and self._stopping and task is not None:
                # The graceful timeout ran out: end the stream properly rather than cut it.
                task.uncancel()
                return await client_failures.fail(client, rec, client_failures.shutting_down())
            gone = client_failures.client_gone(client, rec)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return gone
        finally:
            client.close()
            self._active.discard(task)
            rec.total_s = time.perf_counter() - started
            metrics.TALLY.counts[metrics.requests_child(path, rec.status, rec.model or "")] += 1
            self.access_log.write(rec)

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
        """Attempts until one succeeds or a failure may not be tried again: retried before
        visible output (docs/behaviour.md "Recovery"), continued after it (docs/behaviour.md "Migration")."""
        state = self.state
        avoid: set[str] = set()
        cut_by: set[str] = set()  # the consumers that cut this stream: a continuation never goes back
        retrying = migrating = False
        attempts = 0
        loop = self._loop
        assert loop is not None  # handle() took it
        migration = Migration.of(req, self.recovery.max_migrations, loop.time, self.buffers)
        leg = req  # the request the next attempt sends: the client's, or a continuation of its stream
        cut: EngineError | None = None  # the fault the running continuation continues after
        state.request_started()
        try:
            while True:
                attempts += 1
                rec.attempts = attempts
                try:
                    return await self.attempts.run(client, leg, rec, started, frozenset(avoid), migration,
                                                   frozenset(cut_by) if cut_by else _NO_ENGINES)
                except NarwhalError as exc:
                    if not isinstance(exc, EngineError):
                        if cut is not None:  # a continuation found no pair, or no time: the cut ends it
                            raise cut from None
                        raise
                    if client.committed:
                        if migration is None:
                            raise  # "Failure semantics"'s terminal event
                        if migration.finished():  # the client has its whole answer: complete it
                            return await self._complete(client, req, rec, migration)
                        if cut is not None and not migration.continuing and _refused(exc):
                            raise cut from None  # a continuation refused (4xx): the client never sent it
                        after = self._continuation(exc, req, rec, migration, cut_by, migrating)
                        if after is None:
                            raise
                        migrating = True
                        avoid.add(exc.engine)
                        leg, cut = after, exc
                        rec.migrations += 1
                        metrics.MIGRATIONS.labels(exc.reason).inc()
                        continue
                    if not self._retryable(exc, req, attempts, client) or not (retrying or self._budget_allows()):
                        raise
                    retrying = True
                    avoid.add(exc.engine)
                    metrics.RETRIES.inc()
                    if exc.phase == "decode" and exc.pair is not None and exc.pair[0] != exc.pair[1]:
                        avoid.add(exc.pair[0])  # a pre-token crossed fault may be the producer's
        finally:
            if retrying:
                state.retry_finished()
            if migrating:
                state.migration_finished()
            if migration is not None and migration.transcript.held:
                migration.transcript.close()  # what it held of the worker's budget
            state.request_finished()

    def _budget_allows(self) -> bool:
        """This request may start retrying: the fleet-wide retry budget has room (counted if not)."""
        if self.state.try_start_retry(self.recovery.retry_budget_ratio, self.recovery.retry_budget_min):
            return True
        metrics.RETRY_BUDGET_EXHAUSTED.inc()
        return False

    def _continuation(self, exc: EngineError, req: ClientRequest, rec: AccessRecord, migration: Migration,
                      cut_by: set[str], migrating: bool) -> ClientRequest | None:
        """The request that continues the stream ``exc`` cut, or None: the stream's own rules
        (count, reason, deadline), then another consumer to go to, then the fleet's bound on
        streams migrating at once (docs/decisions.md "Migration"), and only then the transcript."""
        if not migration.may_continue(exc, req.deadline, asyncio.get_running_loop().time()):
            return None
        if exc.phase == "decode":
            cut_by.add(exc.engine)
        if not self.placement.servable(req.model, req.local, frozenset(cut_by)):
            log.info("stream not continued after %s: no consumer but the one that cut it", exc.reason)
            return None
        if not migrating and not self.state.try_start_migration(self.recovery.migration_budget_ratio,
                                                                 self.recovery.migration_budget_min):
            metrics.MIGRATION_BUDGET_EXHAUSTED.inc()
            return None
        after = migration.after(exc, req, asyncio.get_running_loop().time(), rec.prompt_tokens)
        if after is None and not migrating:
            self.state.migration_finished()
        return after

    @staticmethod
    async def _complete(client: ClientStream, req: ClientRequest, rec: AccessRecord,
                        migration: Migration) -> web.StreamResponse:
        """A stream cut after its finish went out is complete (docs/behaviour.md "Migration"): its
        end goes out (the usage chunk from Narwhal's count when asked for and missing); the
        consumer was charged the early close by its attempt."""
        await client.write(migration.completion(wants_usage(req.body), rec.prompt_tokens), eof=True)
        assert client.stream is not None
        return client.stream

    def _retryable(self, exc: EngineError, req: ClientRequest, attempts: int, client: ClientStream) -> bool:
        """May a fresh attempt cure ``exc`` (docs/behaviour.md "Recovery")? Never once output went
        out (that is a migration's call).
        """
        if attempts > self.recovery.max_retries or client.committed:
            return False
        return retryable(exc.reason, exc.status) and asyncio.get_running_loop().time() < req.deadline

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_background(self, timeout: float) -> None:
        """At shutdown, once requests are done: wait up to ``timeout`` for spawned follow-up tasks."""
        if self._drain_timer is not None:
            self._drain_timer.cancel()  # every request is done: nothing left to end
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)
