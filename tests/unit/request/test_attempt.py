"""One attempt (narwhal.request.attempt.Attempts) with fake legs: outcomes, reservations, what
the client was sent, and the attempt's moves through its states (``request.attempt_state``)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest

from narwhal.engines import endpoints
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import EngineError
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from tests.unit.request.attempt_support import (
    Client,
    Engines,
    Leg,
    client_request,
    held,
    setup_attempts,
)


async def test_a_stream_goes_out_in_order_and_reports_success_with_nothing_held() -> None:
    engines = Engines(leg=Leg([b"data: t0\n\n", b"data: t1\n\ndata: [DONE]\n\n"]))
    attempts, state, reports, spawned = setup_attempts(engines)
    client = Client()
    rec = AccessRecord(request_id="c1", endpoint="/v1/completions")
    await attempts.run(client, client_request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    # The terminal span ended the body itself: no empty end-of-body write after it.
    assert client.written == [b"data: t0\n\n", b"data: t1\n\ndata: [DONE]\n\n"]
    assert reports.seen == [{"producer": "p0", "consumer": "d0", "ok": True, "reason": None,
                             "before_first_token": False}]
    assert (rec.producer, rec.consumer) == ("p0", "d0") and rec.first_byte_s is not None
    assert held(state) == ([0, 0], [0, 0]) and engines.leg is not None and engines.leg.closed
    assert spawned == [] and engines.releases == []


@pytest.mark.parametrize("spans", [
    # the usage event alone in a span the attempt writes itself, [DONE] after it on its own
    [b"data: t0\n\n", b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n', b"data: [DONE]\n\n"],
    # the usage event with [DONE]
    [b"data: t0\n\n", b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'],
])
async def test_the_usage_count_is_taken_from_whichever_span_held_it(spans: list[bytes]) -> None:
    attempts, _, _, _ = setup_attempts(Engines(leg=Leg(list(spans))))
    req = client_request()
    req.body["stream_options"] = {"include_usage": True}
    rec = AccessRecord(request_id="c1", endpoint="/v1/completions", attempts=1)
    await attempts.run(Client(), req, rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert rec.completion_tokens == 2
    assert rec.backend_ids and rec.backend_ids[0].startswith("c1-") and rec.backend_ids[0].endswith("-a1")


async def test_a_failure_before_the_first_token_is_reported_as_such_and_releases_nothing_decoded() -> None:
    fault = EngineError("boom", reason="engine_disconnect", engine="d0", phase="decode")
    engines = Engines(leg=Leg([], fail_at=fault))
    attempts, state, reports, spawned = setup_attempts(engines)
    client = Client()
    with pytest.raises(EngineError):
        await attempts.run(client, client_request(), AccessRecord(request_id="c", endpoint="e"), 0.0, frozenset())  # type: ignore[arg-type]
    assert not client.committed
    (seen,) = reports.seen
    assert seen["ok"] is False and seen["reason"] == "engine_disconnect" and seen["before_first_token"] is True
    assert held(state) == ([0, 0], [0, 0]) and spawned == []  # the consumer had the handoff


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
    attempts, state, reports, spawned = setup_attempts(engines)
    rec = AccessRecord(request_id="c", endpoint="/v1/completions")
    await attempts.run(Client(), _local(client_request()), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert engines.prefills == 0
    (result,) = engines.decoded
    assert (result.descriptor, result.crossed, result.endpoint) == (None, False, endpoints.COMPLETIONS)
    assert (rec.mode, rec.producer, rec.consumer, rec.ttft_s) == ("local", None, "d0", None)
    assert reports.seen == [{"producer": "d0", "consumer": "d0", "ok": True, "reason": None,
                             "before_first_token": False}]
    assert held(state) == ([0, 0], [0, 0]) and spawned == [] and engines.releases == []


async def test_a_local_decode_failure_is_the_consumers_before_its_first_token() -> None:
    fault = EngineError("boom", reason="engine_disconnect", engine="d0", phase="decode")
    engines = CountingEngines(Leg([], fail_at=fault))
    attempts, state, reports, spawned = setup_attempts(engines)
    with pytest.raises(EngineError) as raised:
        await attempts.run(Client(), _local(client_request()), AccessRecord(request_id="c", endpoint="e"), 0.0,  # type: ignore[arg-type]
                           frozenset())
    assert raised.value.pair == ("d0", "d0")  # the retry avoids that consumer, and no producer
    (seen,) = reports.seen
    assert (seen["producer"], seen["consumer"], seen["reason"], seen["before_first_token"]) == (
        "d0", "d0", "engine_disconnect", True)
    assert held(state) == ([0, 0], [0, 0]) and spawned == [] and engines.releases == []


async def test_a_disaggregated_attempt_records_its_mode_and_the_prefills_tokens() -> None:
    class Cached(Engines):
        async def prefill(self, producer: Any, endpoint: str, body: Any, **kw: Any) -> PrefillResult:
            result = await super().prefill(producer, endpoint, body, **kw)
            result.prompt_tokens, result.cached_tokens = 300, 256
            return result

    engines = Cached(leg=Leg([b"data: t0\n\ndata: [DONE]\n\n"]))
    attempts, _, _, _ = setup_attempts(engines)
    rec = AccessRecord(request_id="c", endpoint="/v1/completions")
    await attempts.run(Client(), client_request(), rec, 0.0, frozenset())  # type: ignore[arg-type]
    assert (rec.mode, rec.producer, rec.prompt_tokens, rec.cached_tokens) == ("disaggregated", "p0", 300, 256)
    assert rec.ttft_s is not None


@dataclass
class Moves:
    """An attempt observer that writes down every move, as tracing would see it."""

    seen: list[tuple[str, str, str | None]] = field(default_factory=list)

    def moved(self, life: Any, before: Any, error: BaseException | None) -> None:
        reason = None if error is None else getattr(error, "reason", type(error).__name__)
        self.seen.append((before.value, life.state.value, reason))


async def _moves(engines: Engines, *, stream: bool = True, client: Client | None = None) -> list[Any]:
    attempts, state, _, _ = setup_attempts(engines)
    attempts.observer = moves = Moves()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await attempts.run(client or Client(), client_request(stream), AccessRecord(request_id="c", endpoint="e"), 0.0,
                           frozenset())  # type: ignore[arg-type]
    assert held(state) == ([0, 0], [0, 0])
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
