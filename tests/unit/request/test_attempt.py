"""One attempt (narwhal.request.attempt.Attempts) with fake legs: outcomes, reservations and the
three handoff-release cases, decided by what the client was sent (``committed``), not by a log."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from narwhal.engines.connector import PrefillResult
from narwhal.errors import EngineError
from narwhal.fleet import Engine, Fleet
from narwhal.fleet.placement import Placement
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from narwhal.request.attempt import Attempts
from narwhal.request.outcomes import Outcomes
from narwhal.settings import Settings
from narwhal.shm.local import LocalFleetState

DESCRIPTOR = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}


@dataclass
class Leg:
    spans: list[bytes]
    fail_at: EngineError | None = None
    closed: bool = False
    relayed: int = 0  # spans a direct relay would have written (none here)

    async def open(self) -> bytes | None:
        return None

    last: bytes = b""

    async def next_span(self) -> bytes | None:
        if not self.spans:
            if self.fail_at is not None:
                raise self.fail_at
            return None
        self.last = self.spans.pop(0)
        return self.last

    @property
    def ended(self) -> bool:  # as DecodeLeg.ended: the span just returned held the terminal event
        return self.last.endswith(b"data: [DONE]\n\n")

    def close(self) -> None:
        self.closed = True


@dataclass
class Engines:
    """Stands in for EngineClient: a prefill answer, then a decode leg (or its refusal)."""

    leg: Leg | None = None
    refuse: EngineError | None = None
    releases: list[str] = field(default_factory=list)

    async def prefill(self, producer: Any, endpoint: str, body: Any, **_: Any) -> PrefillResult:
        return PrefillResult(producer=producer.name, producer_url=producer.url, endpoint=endpoint,
                             request_id="r1", descriptor=dict(DESCRIPTOR))

    def decode_leg(self, result: PrefillResult, consumer: Any, body: Any, **_: Any) -> Leg:
        if self.refuse is not None:
            raise self.refuse
        assert self.leg is not None
        return self.leg

    async def release(self, result: PrefillResult, consumer: Any, body: Any, **_: Any) -> bool:
        self.releases.append(consumer.name)
        return True


@dataclass
class Client:
    """Stands in for ClientStream: records what the client was sent."""

    committed: bool = False
    written: list[bytes] = field(default_factory=list)
    stream: Any = None
    leave_on_write: bool = False

    def relay_sink(self) -> Any:
        return lambda span: True

    async def commit_stream(self) -> None:
        self.committed, self.stream = True, object()

    async def write(self, data: bytes, *, eof: bool = False) -> None:
        if self.leave_on_write:
            raise ConnectionResetError("gone")
        self.written.append(data)

    async def drain(self) -> None: ...


@dataclass
class Reports:
    seen: list[dict[str, Any]] = field(default_factory=list)

    def report(self, producer: Engine, consumer: Engine, *, error: EngineError | None = None,
               failed: Engine | None = None, before_first_token: bool = False, local: bool = False) -> None:
        self.seen.append({"producer": producer.name, "consumer": consumer.name, "ok": error is None,
                          "reason": None if error is None else error.reason, "before_first_token": before_first_token})

    def quarantine(self, engine: Engine, seconds: float) -> None: ...


def _setup(engines: Engines) -> tuple[Attempts, LocalFleetState, Reports, list[Any]]:
    settings = Settings.model_validate({"engines": [
        {"name": "p0", "url": "http://127.0.0.1:1", "role": "producer", "models": ["m"]},
        {"name": "d0", "url": "http://127.0.0.1:2", "role": "consumer", "models": ["m"]},
    ]})
    fleet = Fleet(settings)
    state = LocalFleetState(fleet)
    reports = Reports()
    spawned: list[Any] = []
    attempts = Attempts(settings, Placement(fleet, state, state, settings.placement), engines,  # type: ignore[arg-type]
                        Outcomes(fleet, reports, 0), spawned.append)
    return attempts, state, reports, spawned


def _request(stream: bool = True) -> ClientRequest:
    deadline = asyncio.get_running_loop().time() + 30
    return ClientRequest(endpoint="/v1/completions", body={"model": "m", "prompt": "x"}, model="m", stream=stream,
                         deadline=deadline, forward={})


def _held(state: LocalFleetState) -> tuple[list[int], list[int]]:
    return state.both_totals()


async def test_a_stream_goes_out_in_order_and_reports_success_with_nothing_held() -> None:
    engines = Engines(leg=Leg([b"data: t0\n\n", b"data: t1\n\ndata: [DONE]\n\n"]))
    attempts, state, reports, spawned = _setup(engines)
    client = Client()
    rec = AccessRecord(request_id="c1", endpoint="/v1/completions")
    await attempts.run(client, _request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert client.written == [b"data: t0\n\n", b"data: t1\n\ndata: [DONE]\n\n", b""]
    assert reports.seen == [{"producer": "p0", "consumer": "d0", "ok": True, "reason": None,
                             "before_first_token": False}]
    assert (rec.producer, rec.consumer) == ("p0", "d0") and rec.first_byte_s is not None
    assert _held(state) == ([0, 0], [0, 0]) and engines.leg is not None and engines.leg.closed
    assert spawned == [] and engines.releases == []


@pytest.mark.parametrize("spans", [
    # the usage event alone in a span the attempt writes itself, [DONE] after it on its own
    [b"data: t0\n\n", b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n', b"data: [DONE]\n\n"],
    # the usage event with [DONE]
    [b"data: t0\n\n", b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'],
])
async def test_the_usage_count_is_taken_from_whichever_span_held_it(spans: list[bytes]) -> None:
    attempts, _, _, _ = _setup(Engines(leg=Leg(list(spans))))
    req = _request()
    req.body["stream_options"] = {"include_usage": True}
    rec = AccessRecord(request_id="c1", endpoint="/v1/completions", attempts=1)
    await attempts.run(Client(), req, rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert rec.completion_tokens == 2
    assert rec.backend_ids and rec.backend_ids[0].startswith("c1-") and rec.backend_ids[0].endswith("-a1")


async def test_a_failure_before_the_first_token_is_reported_as_such_and_releases_nothing_decoded() -> None:
    fault = EngineError("boom", reason="engine_disconnect", engine="d0", phase="decode")
    engines = Engines(leg=Leg([], fail_at=fault))
    attempts, state, reports, spawned = _setup(engines)
    client = Client()
    with pytest.raises(EngineError):
        await attempts.run(client, _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert not client.committed
    (seen,) = reports.seen
    assert seen["ok"] is False and seen["reason"] == "engine_disconnect" and seen["before_first_token"] is True
    assert _held(state) == ([0, 0], [0, 0]) and spawned == []  # the consumer had the handoff


async def test_an_expired_handoff_is_released_to_the_consumer() -> None:
    expired = EngineError("old", reason="handoff_expired", engine="p0", phase="prefill")
    expired.counts = False
    engines = Engines(refuse=expired)
    attempts, state, reports, spawned = _setup(engines)
    with pytest.raises(EngineError):
        await attempts.run(Client(), _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert len(spawned) == 1
    await spawned[0]
    assert engines.releases == ["d0"] and _held(state) == ([0, 0], [0, 0])


async def test_an_invalid_handoff_is_sent_nowhere() -> None:
    engines = Engines(refuse=EngineError("bad", reason="invalid_handoff", engine="p0", phase="prefill"))
    attempts, _, reports, spawned = _setup(engines)
    with pytest.raises(EngineError):
        await attempts.run(Client(), _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert spawned == [] and engines.releases == [] and reports.seen[0]["reason"] == "invalid_handoff"


async def test_a_client_gone_after_the_first_token_releases_no_handoff() -> None:
    engines = Engines(leg=Leg([b"data: t0\n\n", b"data: [DONE]\n\n"]))
    attempts, state, _, spawned = _setup(engines)
    client = Client(leave_on_write=True)
    with pytest.raises(ConnectionResetError):
        await attempts.run(client, _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    # Committed: the consumer had the handoff and is decoding it; closing the leg aborts it.
    assert client.committed and spawned == [] and engines.leg is not None and engines.leg.closed
    assert _held(state) == ([0, 0], [0, 0])


async def test_a_client_gone_before_the_first_token_has_its_handoff_released() -> None:
    class Gone(Leg):
        async def next_span(self) -> bytes | None:
            raise asyncio.CancelledError  # the handler is cancelled while waiting for the token

    engines = Engines(leg=Gone([]))
    attempts, state, _, spawned = _setup(engines)
    with pytest.raises(asyncio.CancelledError):
        await attempts.run(Client(), _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert len(spawned) == 1
    await spawned[0]
    assert engines.releases == ["d0"] and _held(state) == ([0, 0], [0, 0])


class CountingEngines(Engines):
    """Engines that count prefills and keep what each decode leg was given."""

    def __init__(self, leg: Leg) -> None:
        super().__init__(leg=leg)
        self.prefills = 0
        self.decoded: list[PrefillResult] = []

    async def prefill(self, producer: Any, endpoint: str, body: Any, **kw: Any) -> PrefillResult:
        self.prefills += 1
        return await super().prefill(producer, endpoint, body, **kw)

    def decode_leg(self, result: PrefillResult, consumer: Any, body: Any, **kw: Any) -> Leg:
        self.decoded.append(result)
        return super().decode_leg(result, consumer, body, **kw)


def _local(request: ClientRequest) -> ClientRequest:
    request.local = True
    return request


async def test_a_local_decode_has_no_prefill_no_descriptor_and_reports_its_consumer() -> None:
    engines = CountingEngines(Leg([b"data: t0\n\ndata: [DONE]\n\n"]))
    attempts, state, reports, spawned = _setup(engines)
    rec = AccessRecord(request_id="c", endpoint="/v1/completions")
    await attempts.run(Client(), _local(_request()), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert engines.prefills == 0
    (result,) = engines.decoded
    assert (result.descriptor, result.crossed, result.endpoint) == (None, False, "/v1/completions")
    assert (rec.mode, rec.producer, rec.consumer, rec.ttft_s) == ("local", None, "d0", None)
    assert reports.seen == [{"producer": "d0", "consumer": "d0", "ok": True, "reason": None,
                             "before_first_token": False}]
    assert _held(state) == ([0, 0], [0, 0]) and spawned == [] and engines.releases == []


async def test_a_local_decode_failure_is_the_consumers_before_its_first_token() -> None:
    fault = EngineError("boom", reason="engine_disconnect", engine="d0", phase="decode")
    engines = CountingEngines(Leg([], fail_at=fault))
    attempts, state, reports, spawned = _setup(engines)
    with pytest.raises(EngineError) as raised:
        await attempts.run(Client(), _local(_request()), AccessRecord(request_id="c", endpoint="e"), 0.0,  # type: ignore[arg-type]
                           frozenset())
    assert raised.value.pair == ("d0", "d0")  # the retry avoids that consumer, and no producer
    (seen,) = reports.seen
    assert (seen["producer"], seen["consumer"], seen["reason"], seen["before_first_token"]) == (
        "d0", "d0", "engine_disconnect", True)
    assert _held(state) == ([0, 0], [0, 0]) and spawned == [] and engines.releases == []


async def test_a_disaggregated_attempt_records_its_mode_and_the_prefills_tokens() -> None:
    class Cached(Engines):
        async def prefill(self, producer: Any, endpoint: str, body: Any, **kw: Any) -> PrefillResult:
            result = await super().prefill(producer, endpoint, body, **kw)
            result.prompt_tokens, result.cached_tokens = 300, 256
            return result

    engines = Cached(leg=Leg([b"data: t0\n\ndata: [DONE]\n\n"]))
    attempts, _, _, _ = _setup(engines)
    rec = AccessRecord(request_id="c", endpoint="/v1/completions")
    await attempts.run(Client(), _request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert (rec.mode, rec.producer, rec.prompt_tokens, rec.cached_tokens) == ("disaggregated", "p0", 300, 256)
    assert rec.ttft_s is not None
