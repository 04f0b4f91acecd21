"""End to end: real gunicorn with ``[tracing] enabled``, exporting over OTLP/HTTP
to a receiver this test runs; the protobuf it gets is decoded with ``opentelemetry-proto`` and
the span tree, names and attributes are checked, with the ``traceparent`` each engine received.
A router whose ``[tracing]`` sets nothing but ``enabled`` takes the endpoint,
the service name and the sampler from the standard ``OTEL_*`` variables, and the access log
names each request's trace."""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    access_line,
    completion,
    http_request,
    records,
    send,
    start_router,
    unique_prompt,
)

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2


@dataclass
class Received:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any]
    status: int
    service: str


def _value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, which) if which else None


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1 (its own thread and loop)."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        got = []
        for rs in export.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Received(
                        s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes}, s.status.code, service,
                    ))
        with self._lock:
            self.spans.extend(got)
        return web.Response(status=200, content_type="application/x-protobuf", body=b"")

    def start(self) -> Receiver:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def trace(self, trace_id: str, count: int, timeout: float = 20) -> list[Received]:
        """The spans of ``trace_id`` once ``count`` of them arrived (bounded)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {count} spans of trace {trace_id}: {found}")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    recv = Receiver().start()
    yield recv
    recv.stop()


@pytest.fixture(scope="module")
def traced(fleet: FakeFleet, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(
        fleet, engines, tmp_path_factory.mktemp("traced"),
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # export within 0.1 s rather than the default 5 s
        tracing={"enabled": True, "endpoint": receiver.url, "service_name": "narwhal-test"},
        recovery={"max_migrations": 1},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def traced_pair(fleet: FakeFleet, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        RouterProcess]:
    """Traced like ``traced``, with a second consumer for a migration to go to (never the one that cut)."""
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"},
               {"name": "sd1", "role": "consumer"}]
    proc = start_router(
        fleet, engines, tmp_path_factory.mktemp("traced_pair"), env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        tracing={"enabled": True, "endpoint": receiver.url, "service_name": "narwhal-test"},
        recovery={"max_migrations": 1},
    )
    yield proc
    proc.stop()


def _by_name(spans: list[Received]) -> dict[str, Received]:
    names = [s.name for s in spans]
    assert len(names) == len(set(names)), names
    return {s.name: s for s in spans}


async def test_a_request_makes_a_server_span_with_placement_prefill_and_decode_children(
    traced: RouterProcess, receiver: Receiver, fleet: FakeFleet
) -> None:
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    prompt = unique_prompt(words=30)  # over affinity_min_chars: the request has an affinity key
    rid = "traced-" + prompt.split()[0]
    reply = await send(traced.url, "/v1/completions", completion(prompt, max_tokens=3),
                       headers={"x-request-id": rid, "traceparent": f"00-{trace_id}-{client_span}-01",
                                "tracestate": "vendor=1"})
    assert reply.status == 200
    spans = _by_name(receiver.trace(trace_id, 4))
    assert set(spans) == {"POST /v1/completions", "narwhal.placement", "narwhal.prefill", "narwhal.decode"}
    server = spans["POST /v1/completions"]
    assert server.kind == SERVER and server.parent == client_span and server.service == "narwhal-test"
    for name in ("narwhal.placement", "narwhal.prefill", "narwhal.decode"):
        assert spans[name].parent == server.span_id, name
    assert spans["narwhal.prefill"].kind == spans["narwhal.decode"].kind == CLIENT
    (prefill_rec,) = records(fleet, "p2", prompt)
    (decode_rec,) = records(fleet, "d2", prompt)
    backend = prefill_rec["headers"]["x-request-id"]
    # Each engine got its own leg's span as parent, in the client's trace, sampled; tracestate kept.
    assert prefill_rec["headers"]["traceparent"] == f"00-{trace_id}-{spans['narwhal.prefill'].span_id}-01"
    assert decode_rec["headers"]["traceparent"] == f"00-{trace_id}-{spans['narwhal.decode'].span_id}-01"
    assert prefill_rec["headers"]["tracestate"] == decode_rec["headers"]["tracestate"] == "vendor=1"
    prefill, decode, placement = spans["narwhal.prefill"].attributes, spans["narwhal.decode"].attributes, \
        spans["narwhal.placement"].attributes
    assert placement["narwhal.producer"] == "p2" and placement["narwhal.consumer"] == "d2"
    # One producer: the key's favourite, and chosen as such.
    assert placement["narwhal.producer_choice"] == "affinity" and placement["narwhal.local"] is False
    assert prefill["narwhal.engine"] == "p2" and prefill["narwhal.attempt"] == 1
    assert prefill["narwhal.backend_id"] == decode["narwhal.backend_id"] == backend
    assert decode["narwhal.engine"] == "d2" and decode["narwhal.attempt"] == 1
    assert 0 <= decode["narwhal.handoff_age_s"] < 5
    attrs = server.attributes
    assert attrs["http.response.status_code"] == 200 and attrs["narwhal.request_id"] == rid
    assert attrs["narwhal.backend_ids"] == [backend] and attrs["narwhal.attempts"] == 1
    assert "narwhal.reason" not in attrs and server.status != STATUS_ERROR
    assert access_line(traced, rid)["trace_id"] == trace_id


async def test_a_failed_leg_carries_its_reason_and_a_new_trace_starts_without_a_traceparent(
    traced: RouterProcess, receiver: Receiver, fleet: FakeFleet
) -> None:
    prompt = unique_prompt()
    reply = await send(traced.url, "/v1/completions", completion(prompt, fake={"prefill": {"status": 500}}))
    assert reply.status == 502
    (rec,) = records(fleet, "p2", prompt)
    trace_id = rec["headers"]["traceparent"].split("-")[1]
    spans = _by_name(receiver.trace(trace_id, 3))
    assert set(spans) == {"POST /v1/completions", "narwhal.placement", "narwhal.prefill"}  # no decode
    server, prefill = spans["POST /v1/completions"], spans["narwhal.prefill"]
    assert server.parent == ""  # a root: the client sent no traceparent
    assert access_line(traced, server.attributes["narwhal.request_id"])["trace_id"] == trace_id  # the new trace
    assert prefill.status == server.status == STATUS_ERROR
    assert prefill.attributes["narwhal.reason"] == server.attributes["narwhal.reason"] == "engine_5xx"
    assert server.attributes["http.response.status_code"] == 502


async def test_a_migrated_stream_has_a_span_per_leg(traced_pair: RouterProcess, receiver: Receiver) -> None:
    trace_id = os.urandom(16).hex()
    reply = await send(traced_pair.url, "/v1/completions",
                       completion(unique_prompt(), max_tokens=5, fake={"decode": {"close_after": 2}}),
                       headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
    assert reply.status == 200 and reply.events[-1] == b"[DONE]"
    spans = receiver.trace(trace_id, 7)
    decodes = sorted((s for s in spans if s.name == "narwhal.decode"), key=lambda s: s.attributes["narwhal.attempt"])
    assert [s.attributes["narwhal.migration"] for s in decodes] == [0, 1]
    assert decodes[0].status == STATUS_ERROR and decodes[0].attributes["narwhal.reason"] == "engine_disconnect"
    assert decodes[1].status != STATUS_ERROR
    assert sum(s.name == "narwhal.prefill" for s in spans) == 2
    server = next(s for s in spans if s.name == "POST /v1/completions")
    assert server.attributes["narwhal.migrations"] == 1 and "narwhal.reason" not in server.attributes


def test_an_invalid_tracestate_is_dropped_and_the_client_trace_continued(
    traced: RouterProcess, receiver: Receiver, fleet: FakeFleet
) -> None:
    # docs/behaviour.md "The request path": invalid trace context is dropped, never a 5xx; the valid traceparent still
    # counts.
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    prompt = unique_prompt()
    answer = http_request(traced, "POST", "/v1/completions", orjson.dumps(completion(prompt, max_tokens=2)),
                          headers=[("traceparent", f"00-{trace_id}-{client_span}-01"), ("tracestate", "v=€".encode())])
    assert answer.status == 200, answer.body
    spans = _by_name(receiver.trace(trace_id, 4))
    assert spans["POST /v1/completions"].parent == client_span
    for rec in records(fleet, "p2", prompt) + records(fleet, "d2", prompt):
        assert "tracestate" not in rec["headers"], rec["headers"]
        assert rec["headers"]["traceparent"].split("-")[1] == trace_id


@pytest.fixture(scope="module")
def otel_traced(fleet: FakeFleet, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[RouterProcess]:
    """Only ``enabled = true`` in [tracing]: the rest comes from the OTEL_* variables."""
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    env = {
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url.removesuffix("/v1/traces"),  # + /v1/traces, as specified
        "OTEL_SERVICE_NAME": "narwhal-from-otel-env",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",  # new traces never sampled; a client's sampled flag still wins
    }
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("otel"), env=env, tracing={"enabled": True})
    yield proc
    proc.stop()


async def test_unset_tracing_settings_are_the_standard_otel_variables(
    otel_traced: RouterProcess, receiver: Receiver, fleet: FakeFleet
) -> None:
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    prompt = unique_prompt()
    rid = "otel-" + prompt.split()[0]
    reply = await send(otel_traced.url, "/v1/completions", completion(prompt, max_tokens=2),
                       headers={"x-request-id": rid, "traceparent": f"00-{trace_id}-{client_span}-01"})
    assert reply.status == 200
    # Exported to OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, as OTEL_SERVICE_NAME.
    spans = _by_name(receiver.trace(trace_id, 4))
    assert {s.service for s in spans.values()} == {"narwhal-from-otel-env"}
    assert spans["POST /v1/completions"].parent == client_span
    assert access_line(otel_traced, rid)["trace_id"] == trace_id

    # OTEL_TRACES_SAMPLER_ARG=0: a new trace is not sampled, and the legs say so.
    prompt = unique_prompt()
    rid = "otel-" + prompt.split()[0]
    reply = await send(otel_traced.url, "/v1/completions", completion(prompt, max_tokens=2),
                       headers={"x-request-id": rid})
    assert reply.status == 200
    (rec,) = records(fleet, "p2", prompt)
    version, new_trace, _, flags = rec["headers"]["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 0x01 == 0  # the sampled bit is off (0x02 is "random")
    assert access_line(otel_traced, rid)["trace_id"] == new_trace
