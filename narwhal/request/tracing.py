"""OpenTelemetry tracing of the request path, opt-in (``[tracing] enabled = true``).

A request's trace: one SERVER span (``POST /v1/completions``) from admission to the last
byte, and per attempt CLIENT child spans ``narwhal.placement``, ``narwhal.prefill`` and
``narwhal.decode`` (engine names, attempt number, backend id, handoff age, reason on
failure). Each engine leg is sent the W3C ``traceparent`` of *its own* span (and the client's
``tracestate``), so a vLLM started with ``--otlp-traces-endpoint`` puts its spans under it.

Why an observer and wrappers instead of calls in the hot path: with tracing off nothing here
is imported and the request path is the untraced one — no no-op tracer calls, one ``if`` per
attempt move. With it on, ``narwhal.worker.app`` builds a :class:`TracedRouter`, whose attempts
have an observer (:class:`_LegSpans`, told of each move of the attempt's state table,
``narwhal.request.attempt_state``), a placement whose ``reserve`` opens a span, and an access log
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
from narwhal.engines.endpoints import Endpoint
from narwhal.errors import NarwhalError
from narwhal.fleet.placement import Reservation
from narwhal.reasons import Reason
from narwhal.request.accesslog import AccessRecord
from narwhal.request.attempt import Attempts
from narwhal.request.attempt_state import ENDED, AttemptLife, AttemptState
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
        self, model: str, deadline: float, avoid: frozenset[str] = frozenset(), note: Any = None,
        local: bool = False, exclude: frozenset[str] = frozenset(),
    ) -> Reservation:
        with self._tracer.start_as_current_span(
            "narwhal.placement", record_exception=False, set_status_on_exception=False,
            attributes={"narwhal.model": model, "narwhal.avoid": sorted(avoid), "narwhal.local": local},
        ) as span:
            try:
                resv: Reservation = await self._inner.reserve(model, deadline, avoid, note, local, exclude)
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


_CLIENT_LEFT = ConnectionResetError("the client left mid-prefill")  # _failed: client_disconnect


class _LegSpans:
    """The attempt observer: a CLIENT span over each engine leg, whose context the leg carries.

    It opens the prefill's span as the attempt starts prefilling and the decode's as it starts
    decoding, gives the leg ``traceparent`` (the client's ``tracestate`` kept) through
    ``life.forward``, and ends the span when the attempt moves on; a failed move marks it with
    the reason. A handoff refused before the decode still gets a decode span, failed: every
    attempt that reached its decode has one."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def moved(self, life: AttemptLife, before: AttemptState, error: BaseException | None) -> None:
        state = life.state
        span: Span | None = life.observed
        if state is AttemptState.PREFILLING:
            self._open(life, "narwhal.prefill", self._prefill_attributes(life))
        elif state is AttemptState.DECODING:
            self._close(span, None)
            self._open(life, "narwhal.decode", self._decode_attributes(life))
        elif state is AttemptState.FAILED and before is AttemptState.HANDED_OFF:
            self._close(span, None)
            self._open(life, "narwhal.decode", self._decode_attributes(life))
            self._close(life.observed, error)
        elif state is AttemptState.HANDED_OFF:
            self._close(span, None)
            life.observed = None
        elif state in ENDED:
            # Detached: the client left mid-prefill, which is what the prefill span says.
            self._close(span, _CLIENT_LEFT if state is AttemptState.DETACHED else error)
            life.observed = None

    def _open(self, life: AttemptLife, name: str, attributes: dict[str, Any]) -> None:
        span = self.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes,
                                      record_exception=False, set_status_on_exception=False)
        life.observed = span
        life.forward = {**life.forward, "traceparent": traceparent(span)}

    @staticmethod
    def _close(span: Span | None, error: BaseException | None) -> None:
        if span is None:
            return
        if error is not None:
            _failed(span, error)
        span.end()

    @staticmethod
    def _prefill_attributes(life: AttemptLife) -> dict[str, Any]:
        return {"narwhal.engine": life.resv.producer.name, "narwhal.attempt": attempt_of(life.request_id),
                "narwhal.backend_id": life.request_id, "narwhal.crossed": life.resv.crossed}

    @staticmethod
    def _decode_attributes(life: AttemptLife) -> dict[str, Any]:
        result, resv = life.result, life.resv
        attributes: dict[str, Any] = {
            "narwhal.engine": resv.consumer.name, "narwhal.attempt": life.rec.attempts,
            "narwhal.backend_id": life.request_id, "narwhal.migration": life.rec.migrations,
            "narwhal.crossed": result.crossed if result is not None else resv.crossed,
        }
        if not resv.local and result is not None:  # a local decode had no producer and no handoff
            attributes["narwhal.handoff_age_s"] = result.age()
            attributes["narwhal.producer"] = result.producer
        return attributes


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
        span.set_attribute("narwhal.migrations", rec.migrations)
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
        self.attempts = Attempts(
            settings, _TracedPlacement(self.placement, tracer), self.client, self.outcomes,  # type: ignore[arg-type]
            self._spawn, observer=_LegSpans(tracer),
        )

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
