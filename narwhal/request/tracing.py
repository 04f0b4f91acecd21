"""OpenTelemetry tracing of the request path, opt-in (``[tracing] enabled = true``).

A request's trace: one SERVER span (``POST /v1/completions``) from admission to the last
byte, and per attempt CLIENT child spans ``narwhal.placement``, ``narwhal.prefill`` and
``narwhal.decode`` (engine names, attempt number, backend id, handoff age, reason on
failure). Each engine leg is sent the W3C ``traceparent`` of *its own* span (and the client's
``tracestate``), so a vLLM started with ``--otlp-traces-endpoint`` puts its spans under it.

Why subclasses and wrappers instead of calls in the hot path: with tracing off nothing here
is imported and the request path is exactly the untraced one — no ``if`` per span, no no-op
tracer calls. With it on, ``narwhal.worker.app`` builds a :class:`TracedRouter`, which swaps
in :class:`TracedAttempts`, a placement whose ``reserve`` opens a span, and an access log
that copies the finished record onto the server span (the record holds everything the span
should say, and is written in the handler's context, where the server span is current).

Export: a ``BatchSpanProcessor`` (its own thread) per worker, built in the worker after the
fork (``start``) and flushed when the worker stops (``stop``); the master never imports this.
The sampler is parent-based: a client's sampled flag wins, otherwise ``sample_ratio`` of new
traces are kept. The standard ``OTEL_BSP_*`` variables tune the batch processor, and the standard
``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` and ``OTEL_TRACES_SAMPLER(_ARG)``
fill in whatever ``[tracing]`` leaves unset (``endpoint``, ``service_name``, ``sample_ratio``):
an operator's collector settings work as they do for every other OpenTelemetry service, and a
value written in Narwhal's settings still wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from narwhal import __version__
from narwhal.engines.connector import PrefillResult
from narwhal.engines.endpoints import Endpoint
from narwhal.errors import NarwhalError
from narwhal.fleet.placement import Reservation
from narwhal.reasons import Reason
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from narwhal.request.attempt import Attempts
from narwhal.request.client_stream import ClientStream
from narwhal.request.ids import attempt_of
from narwhal.request.router import Router, RouterParts
from narwhal.settings import TracingSettings

_PROPAGATOR = TraceContextTextMapPropagator()
_PROVIDERS: list[TracerProvider] = []
log = logging.getLogger("narwhal.tracing")

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/traces"
DEFAULT_SERVICE_NAME = "narwhal"


def endpoint(settings: TracingSettings) -> str:
    """``tracing.endpoint``, else the OTLP/HTTP exporter's variables as the specification reads
    them (the traces one as given, the general one + ``/v1/traces``), else the default."""
    if settings.endpoint is not None:
        return settings.endpoint
    if traces := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return traces
    if general := os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return general.rstrip("/") + "/v1/traces"
    return DEFAULT_ENDPOINT


def resource(settings: TracingSettings) -> Resource:
    """``service.name``: ``tracing.service_name``, else ``OTEL_SERVICE_NAME`` or a ``service.name``
    in ``OTEL_RESOURCE_ATTRIBUTES`` (which ``Resource.create`` reads), else ``narwhal``."""
    attributes = {"service.version": __version__ or ""}
    from_env = os.environ.get("OTEL_SERVICE_NAME", "").strip() or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", "")
    if settings.service_name is not None or not from_env:
        attributes["service.name"] = settings.service_name or DEFAULT_SERVICE_NAME
    return Resource.create(attributes)


def sampler(settings: TracingSettings) -> Sampler | None:
    """``tracing.sample_ratio`` (parent-based), else the one ``OTEL_TRACES_SAMPLER`` names (None:
    the SDK builds it, with ``OTEL_TRACES_SAMPLER_ARG``), else parent-based at the ratio
    ``OTEL_TRACES_SAMPLER_ARG`` gives alone, 1.0 without it."""
    if settings.sample_ratio is not None:
        return ParentBased(TraceIdRatioBased(settings.sample_ratio))
    if os.environ.get("OTEL_TRACES_SAMPLER", "").strip():
        return None
    arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    try:
        ratio = float(arg) if arg else 1.0
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a ratio in [0, 1]: sampling every new trace", arg)
        ratio = 1.0
    return ParentBased(TraceIdRatioBased(ratio))


def start(settings: TracingSettings) -> Tracer:
    """The worker's tracer, exporting in batches to :func:`endpoint` (call after fork)."""
    provider = TracerProvider(resource=resource(settings), sampler=sampler(settings))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint(settings))))
    _PROVIDERS.append(provider)
    return provider.get_tracer("narwhal", __version__)


def stop() -> None:
    """Export what is pending and stop the export thread (the worker is stopping)."""
    while _PROVIDERS:
        _PROVIDERS.pop().shutdown()


def traceparent(span: Span) -> str:
    """The W3C ``traceparent`` header value of ``span``."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _failed(span: Span, exc: BaseException) -> None:
    reason = exc.reason if isinstance(exc, NarwhalError) else Reason.CLIENT_DISCONNECT
    span.set_attribute("narwhal.reason", reason)
    span.set_attribute("error.type", reason)
    span.set_status(Status(StatusCode.ERROR, reason))


class _TracedPlacement:
    """The placement, with a span around each ``reserve`` (the wait for a pair included)."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        self._inner = inner
        self._tracer = tracer

    async def reserve(
        self, model: str, deadline: float, avoid: frozenset[str] = frozenset(), key: int | None = None,
        local: bool = False, blocks: Any = None,
    ) -> Reservation:
        with self._tracer.start_as_current_span(
            "narwhal.placement", record_exception=False, set_status_on_exception=False,
            attributes={"narwhal.model": model, "narwhal.avoid": sorted(avoid), "narwhal.local": local},
        ) as span:
            try:
                resv: Reservation = await self._inner.reserve(model, deadline, avoid, key, local, blocks)
            except BaseException as exc:
                _failed(span, exc)
                raise
            if not resv.local:
                span.set_attribute("narwhal.producer", resv.producer.name)
                span.set_attribute("narwhal.producer_choice", resv.choice)
            span.set_attribute("narwhal.consumer", resv.consumer.name)
            span.set_attribute("narwhal.crossed", resv.crossed)
            return resv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _leg_request(req: ClientRequest, span: Span) -> ClientRequest:
    """``req`` whose legs carry ``span``'s context (the client's ``tracestate`` kept)."""
    return dataclasses.replace(req, forward={**req.forward, "traceparent": traceparent(span)})


class TracedAttempts(Attempts):
    """Attempts with a CLIENT span around each engine leg, whose context the engine is sent."""

    tracer: Tracer

    async def _prefill(self, req: ClientRequest, resv: Reservation, request_id: str) -> PrefillResult:
        with self.tracer.start_as_current_span(
            "narwhal.prefill", kind=SpanKind.CLIENT, record_exception=False, set_status_on_exception=False,
            attributes={"narwhal.engine": resv.producer.name, "narwhal.attempt": attempt_of(request_id),
                        "narwhal.backend_id": request_id, "narwhal.crossed": resv.crossed},
        ) as span:
            try:
                return await super()._prefill(_leg_request(req, span), resv, request_id)
            except BaseException as exc:
                _failed(span, exc)
                raise

    def _decode_span(self, resv: Reservation, result: PrefillResult, rec: AccessRecord) -> Any:
        """The decode leg's CLIENT span, made current (a context manager)."""
        attributes: dict[str, Any] = {
            "narwhal.engine": resv.consumer.name, "narwhal.attempt": rec.attempts,
            "narwhal.backend_id": result.request_id, "narwhal.crossed": result.crossed,
        }
        if not resv.local:  # a local decode had no producer and no handoff
            attributes["narwhal.handoff_age_s"] = result.age()
            attributes["narwhal.producer"] = result.producer
        return self.tracer.start_as_current_span(
            "narwhal.decode", kind=SpanKind.CLIENT, record_exception=False, set_status_on_exception=False,
            attributes=attributes,
        )

    def _handoff(
        self, req: ClientRequest, resv: Reservation, result: PrefillResult, rec: AccessRecord, ttft_s: float | None
    ) -> dict[str, Any] | None:
        try:
            return super()._handoff(req, resv, result, rec, ttft_s)
        except BaseException as exc:
            # A refused handoff fails the decode before it starts: its span says so, as one
            # decode span per attempt that reached its decode always has.
            with self._decode_span(resv, result, rec) as span:
                _failed(span, exc)
            raise

    async def _decode(
        self, client: ClientStream, req: ClientRequest, resv: Reservation, result: PrefillResult,
        descriptor: dict[str, Any] | None, rec: AccessRecord, started: float, ttft_s: float | None,
    ) -> web.StreamResponse:
        with self._decode_span(resv, result, rec) as span:
            try:
                return await super()._decode(client, _leg_request(req, span), resv, result, descriptor, rec, started,
                                             ttft_s)
            except BaseException as exc:
                _failed(span, exc)
                raise


class _SpanAnnotatingLog:
    """The access log, copying each finished record onto the current (server) span first."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, rec: AccessRecord) -> None:
        span = trace.get_current_span()
        # The server span's trace: the client's when it sent a valid traceparent, else a new one.
        rec.trace_id = f"{span.get_span_context().trace_id:032x}"
        span.set_attribute("http.response.status_code", rec.status)
        span.set_attribute("narwhal.request_id", rec.request_id)
        span.set_attribute("narwhal.attempts", rec.attempts)
        span.set_attribute("narwhal.backend_ids", rec.backend_ids)
        if rec.model is not None:
            span.set_attribute("narwhal.model", rec.model)
        for key in ("producer", "consumer", "ttft_s", "first_byte_s", "completion_tokens"):
            if (got := getattr(rec, key)) is not None:
                span.set_attribute(f"narwhal.{key}", got)
        if rec.reason is not None:
            span.set_attribute("narwhal.reason", rec.reason)
            span.set_attribute("error.type", rec.reason)
            span.set_status(Status(StatusCode.ERROR, rec.reason))
        self._inner.write(rec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TracedRouter(Router):
    """The router with a SERVER span per request, continuing the client's trace if it sent one."""

    def __init__(self, parts: RouterParts, *, tracer: Tracer) -> None:
        super().__init__(parts)
        settings = parts.settings
        self.tracer = tracer
        self.access_log = _SpanAnnotatingLog(self.access_log)  # type: ignore[assignment]
        attempts = TracedAttempts(
            settings, _TracedPlacement(self.placement, tracer), self.client, self.outcomes,  # type: ignore[arg-type]
            self._spawn,
        )
        attempts.tracer = tracer
        self.attempts = attempts

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """The request under its SERVER span, a child of the client's trace when it sent one."""
        parent = _PROPAGATOR.extract(request.headers)
        with self.tracer.start_as_current_span(
            f"{request.method} {endpoint.path}", context=parent, kind=SpanKind.SERVER,
            record_exception=False, set_status_on_exception=False,
            attributes={"http.request.method": request.method, "url.path": request.path,
                        "http.route": endpoint.path, "client.address": request.remote or ""},
        ):
            return await super().handle(request, endpoint)
