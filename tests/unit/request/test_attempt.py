"""One attempt (narwhal.request.attempt.Attempts) with fake legs: outcomes, reservations and the
handoff-release cases, decided by what the client was sent (``committed``) and whether the
decode went out (``sent``), not by a log; where a release goes when a consumer cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import REGISTRY

from narwhal.engines import endpoints
from narwhal.engines.connector import PrefillResult
from narwhal.engines.relay import Signal
from narwhal.errors import DeadlineExceeded, EngineClientError, EngineError, NarwhalError
from narwhal.fleet import Engine, Fleet
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from narwhal.request.attempt import Attempts
from narwhal.request.outcomes import Outcomes
from narwhal.request.slot_wait import WaitingPlacement
from narwhal.settings import Settings
from narwhal.shm.local import LocalFleetState

DESCRIPTOR = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}


@dataclass
class Leg:
    spans: list[bytes]
    fail_at: EngineError | None = None
    closed: bool = False
    relayed: int = 0  # spans a direct relay would have written (none here)
    connect_fault: NarwhalError | None = None  # open() fails before anything was sent
    sent: bool = False

    async def open(self) -> bytes | None:
        if self.connect_fault is not None:
            raise self.connect_fault
        self.sent = True
        return None

    last: bytes = b""

    async def next_span(self) -> bytes | Signal:
        if not self.spans:
            if self.fail_at is not None:
                raise self.fail_at
            return Signal.END
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
    unreachable: set[str] = field(default_factory=set)  # consumers a release cannot connect to
    descriptor: dict[str, Any] = field(default_factory=lambda: dict(DESCRIPTOR))
    age_s: float = 0.0  # how old the handoff is when the prefill returns
    legs: int = 0  # decode legs built

    async def prefill(self, producer: Any, endpoint: str, body: Any, **_: Any) -> PrefillResult:
        return PrefillResult(producer=producer.name, producer_url=producer.url, endpoint=endpoint,
                             request_id="r1", descriptor=self.descriptor, started_at=time.monotonic() - self.age_s)

    def decode_leg(self, result: PrefillResult, consumer: Any, body: Any, descriptor: Any, **_: Any) -> Leg:
        self.legs += 1
        if self.refuse is not None:
            raise self.refuse
        assert self.leg is not None
        return self.leg

    async def release(self, result: PrefillResult, consumer: Any, body: Any, **_: Any) -> str:
        self.releases.append(consumer.name)
        return "unreachable" if consumer.name in self.unreachable else "released"


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

    async def send_whole(self, body: bytes) -> Any:
        self.committed = True
        self.written.append(body)
        return object()


@dataclass
class Reports:
    seen: list[dict[str, Any]] = field(default_factory=list)

    def report(self, producer: Engine, consumer: Engine, *, error: EngineError | None = None,
               failed: Engine | None = None, before_first_token: bool = False, local: bool = False) -> None:
        self.seen.append({"producer": producer.name, "consumer": consumer.name, "ok": error is None,
                          "reason": None if error is None else error.reason, "before_first_token": before_first_token})

    def quarantine(self, engine: Engine, seconds: float) -> None: ...


def _setup(engines: Engines, consumers: int = 1) -> tuple[Attempts, LocalFleetState, Reports, list[Any]]:
    settings = Settings.model_validate({"engines": [
        {"name": "p0", "url": "http://127.0.0.1:1", "role": "producer", "models": ["m"]},
        *({"name": f"d{i}", "url": f"http://127.0.0.1:{2 + i}", "role": "consumer", "models": ["m"]}
          for i in range(consumers)),
    ]})
    fleet = Fleet(settings)
    state = LocalFleetState(fleet)
    reports = Reports()
    spawned: list[Any] = []
    attempts = Attempts(settings, WaitingPlacement(fleet, state, state, settings.placement), engines,  # type: ignore[arg-type]
                        Outcomes(fleet, reports, 0), spawned.append)
    return attempts, state, reports, spawned


def _request(stream: bool = True) -> ClientRequest:
    deadline = asyncio.get_running_loop().time() + 30
    return ClientRequest(endpoint=endpoints.COMPLETIONS, body={"model": "m", "prompt": "x"}, model="m", stream=stream,
                         deadline=deadline, forward={})


def _held(state: LocalFleetState) -> tuple[list[int], list[int]]:
    return state.both_totals()


async def test_a_stream_goes_out_in_order_and_reports_success_with_nothing_held() -> None:
    engines = Engines(leg=Leg([b"data: t0\n\n", b"data: t1\n\ndata: [DONE]\n\n"]))
    attempts, state, reports, spawned = _setup(engines)
    client = Client()
    rec = AccessRecord(request_id="c1", endpoint="/v1/completions")
    await attempts.run(client, _request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    # The terminal span ended the body itself: no empty end-of-body write after it.
    assert client.written == [b"data: t0\n\n", b"data: t1\n\ndata: [DONE]\n\n"]
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


async def test_an_expired_handoff_is_sent_nowhere_and_counted_abandoned() -> None:
    engines = Engines(age_s=10_000.0)  # older than handoff.max_age_s: the lease may be over (SPEC §11)
    attempts, state, reports, spawned = _setup(engines)
    before = _handoff_counts()
    with pytest.raises(EngineError) as failed:
        await attempts.run(Client(), _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert failed.value.reason == "handoff_expired" and not failed.value.counts and engines.legs == 0
    assert spawned == [] and engines.releases == [] and _held(state) == ([0, 0], [0, 0])
    assert _delta(before) == (0, 1)


async def test_an_invalid_handoff_is_sent_nowhere_and_counted_abandoned() -> None:
    engines = Engines(descriptor={"remote_engine_id": ""})
    attempts, _, reports, spawned = _setup(engines)
    before = _handoff_counts()
    with pytest.raises(EngineError) as failed:
        await attempts.run(Client(), _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert str(failed.value) == "invalid handoff: missing engine identity" and engines.legs == 0
    assert spawned == [] and engines.releases == [] and reports.seen[0]["reason"] == "invalid_handoff"
    assert _delta(before) == (0, 1)


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
        async def next_span(self) -> bytes | Signal:
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

    def decode_leg(self, result: PrefillResult, consumer: Any, body: Any, descriptor: Any, **kw: Any) -> Leg:
        self.decoded.append(result)
        return super().decode_leg(result, consumer, body, descriptor, **kw)


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
    assert (result.descriptor, result.crossed, result.endpoint) == (None, False, endpoints.COMPLETIONS)
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


# -- a handoff the consumer never saw (SPEC §3 step 8): released through a consumer that can pull it --


def _handoff_counts() -> tuple[float, float]:
    return tuple(REGISTRY.get_sample_value(f"narwhal_handoffs_{kind}_total") or 0.0  # type: ignore[return-value]
                 for kind in ("released", "abandoned"))


def _delta(before: tuple[float, float]) -> tuple[float, float]:
    now = _handoff_counts()
    return now[0] - before[0], now[1] - before[1]


async def _run_to_failure(engines: Engines, fault: type[BaseException]) -> tuple[str, list[Any], LocalFleetState]:
    attempts, state, _, spawned = _setup(engines, consumers=2)
    rec = AccessRecord(request_id="c", endpoint="e")
    with pytest.raises(fault):
        await attempts.run(Client(), _request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert rec.consumer is not None
    return rec.consumer, spawned, state


@pytest.mark.parametrize("reason", ["engine_unreachable", "first_token_timeout"])
async def test_a_decode_whose_connect_failed_is_released_through_another_consumer(reason: str) -> None:
    fault = EngineError("no connect", reason=reason, engine="d?", phase="decode")
    engines = Engines(leg=Leg([], connect_fault=fault))
    before = _handoff_counts()
    chosen, spawned, state = await _run_to_failure(engines, EngineError)
    (task,) = spawned
    await task
    other = "d1" if chosen == "d0" else "d0"
    assert engines.releases == [other]  # the chosen one just failed to connect: the other first
    assert _delta(before) == (1, 0) and _held(state) == ([0, 0, 0], [0, 0, 0])


async def test_a_deadline_while_connecting_tries_the_chosen_consumer_first() -> None:
    engines = Engines(leg=Leg([], connect_fault=DeadlineExceeded("the request deadline ran out while decoding")))
    before = _handoff_counts()
    chosen, spawned, _ = await _run_to_failure(engines, DeadlineExceeded)
    engines.unreachable = {chosen}
    await spawned[0]
    other = "d1" if chosen == "d0" else "d0"
    assert engines.releases == [chosen, other] and _delta(before) == (1, 0)


async def test_a_handoff_no_consumer_can_reach_is_abandoned() -> None:
    fault = EngineError("no connect", reason="engine_unreachable", engine="d?", phase="decode")
    engines = Engines(leg=Leg([], connect_fault=fault), unreachable={"d0", "d1"})
    before = _handoff_counts()
    chosen, spawned, _ = await _run_to_failure(engines, EngineError)
    await spawned[0]
    assert engines.releases == ["d1" if chosen == "d0" else "d0", chosen] and _delta(before) == (0, 1)


async def test_a_decode_that_was_sent_then_failed_releases_nothing() -> None:
    # The consumer had the handoff (it may be pulling the blocks): nobody else may pull them too.
    fault = EngineError("boom", reason="engine_5xx", engine="d?", phase="decode")
    engines = Engines(leg=Leg([], fail_at=fault))
    _, spawned, _ = await _run_to_failure(engines, EngineError)
    assert spawned == [] and engines.releases == []


async def test_a_malformed_descriptor_from_an_abandoned_prefill_goes_nowhere() -> None:
    engines = Engines(descriptor={**DESCRIPTOR, "remote_block_ids": [True]})
    attempts, state, _, spawned = _setup(engines, consumers=2)
    resv = attempts.placement.try_place("m")
    assert resv is not None
    before = _handoff_counts()
    rest = engines.prefill(resv.producer, endpoints.COMPLETIONS, {})
    attempts.releases.detach(rest, _request(), resv)
    assert resv.detached
    await spawned[-1]
    assert engines.releases == [] and _delta(before) == (0, 1) and _held(state) == ([0, 0, 0], [0, 0, 0])


async def test_an_abandoned_prefill_releases_its_handoff_to_the_chosen_consumer_holding_no_slot() -> None:
    engines = Engines()
    attempts, state, _, spawned = _setup(engines, consumers=2)
    resv = attempts.placement.try_place("m")
    assert resv is not None
    held_during: list[tuple[list[int], list[int]]] = []
    release = engines.release

    async def watched(*args: Any, **kw: Any) -> str:
        prefill, decode = _held(state)
        held_during.append((list(prefill), list(decode)))  # copies: the counts are live lists
        return await release(*args, **kw)

    engines.release = watched  # type: ignore[method-assign]
    rest = engines.prefill(resv.producer, endpoints.COMPLETIONS, {})
    attempts.releases.detach(rest, _request(), resv)
    assert resv.detached
    await spawned[-1]
    assert engines.releases == [resv.consumer.name] and held_during == [([0, 0, 0], [0, 0, 0])]


async def _refused_by_the_consumer(version: str | None) -> tuple[Engines, list[Any]]:
    """A decode the consumer (of ``version``) answers 400 before any output (SPEC §11 "a consumer's refusal")."""
    refusal = EngineClientError("max_tokens is too large", engine="d0", phase="decode", status=400)
    engines = Engines(leg=Leg([], fail_at=refusal))
    attempts, state, _, spawned = _setup(engines)
    attempts.placement.fleet.set_version(attempts.placement.fleet.by_name["d0"], version)
    with pytest.raises(EngineClientError):
        await attempts.run(Client(), _request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    for task in spawned:
        await task
    assert _held(state) == ([0, 0], [0, 0])
    return engines, spawned


async def test_a_refused_decode_is_released_unless_the_consumers_vllm_frees_it_itself() -> None:
    for version in ("0.11.0", "0.20.2", None):  # no cleanup in these releases, or not known
        engines, spawned = await _refused_by_the_consumer(version)
        assert len(spawned) == 1 and engines.releases == ["d0"], version
    for version in ("0.21.0", "0.33.0"):  # _with_kv_transfer_rejection_cleanup frees it
        engines, spawned = await _refused_by_the_consumer(version)
        assert spawned == [] and engines.releases == [], version


@dataclass
class Moves:
    """An attempt observer that writes down every move, as tracing would see it."""

    seen: list[tuple[str, str, str | None]] = field(default_factory=list)

    def moved(self, life: Any, before: Any, error: BaseException | None) -> None:
        reason = None if error is None else getattr(error, "reason", type(error).__name__)
        self.seen.append((before.value, life.state.value, reason))


async def _moves(engines: Engines, *, stream: bool = True, client: Client | None = None) -> list[Any]:
    attempts, state, _, _ = _setup(engines)
    attempts.observer = moves = Moves()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await attempts.run(client or Client(), _request(stream), AccessRecord(request_id="c", endpoint="e"), 0.0,
                           frozenset())  # type: ignore[arg-type]
    assert _held(state) == ([0, 0], [0, 0])
    return moves.seen


async def test_a_streamed_attempt_moves_through_every_state_to_done() -> None:
    seen = await _moves(Engines(leg=Leg([b"data: t0\n\n", b"data: [DONE]\n\n"])))
    assert seen == [("placed", "prefilling", None), ("prefilling", "handed_off", None),
                    ("handed_off", "decoding", None), ("decoding", "streaming", None), ("streaming", "done", None)]


async def test_a_whole_answer_is_done_without_streaming() -> None:
    class Whole(Leg):
        async def open(self) -> bytes | None:
            self.sent = True
            return b'{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}'

    seen = await _moves(Engines(leg=Whole([])), stream=False)
    assert [after for _, after, _ in seen] == ["prefilling", "handed_off", "decoding", "done"]


async def test_failures_end_the_attempt_in_the_state_they_struck() -> None:
    fault = EngineError("boom", reason="engine_disconnect", engine="d0", phase="decode")
    assert (await _moves(Engines(leg=Leg([], fail_at=fault))))[-1] == ("decoding", "failed", "engine_disconnect")
    # A rejected handoff fails from handed_off: the decode never started.
    assert (await _moves(Engines(age_s=10_000.0)))[-1] == ("handed_off", "failed", "handoff_expired")
    gone = await _moves(Engines(leg=Leg([b"data: t0\n\n", b"data: [DONE]\n\n"])), client=Client(leave_on_write=True))
    assert gone[-1] == ("streaming", "failed", "ConnectionResetError")
