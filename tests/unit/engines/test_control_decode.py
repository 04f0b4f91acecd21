"""A probe's or preflight's decode under the request path's handoff rules
(``narwhal.engines.control_decode``): decoded in time, or given back, or counted abandoned."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.engines.control_decode import decode_to_end
from narwhal.fake_engine import FakeEngine
from narwhal.settings import EngineSettings
from narwhal.testing.harness import DeadEngine

BODY = {"model": "fake-model", "prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 2}
STREAM = {**BODY, "stream": True}


class Ref:
    def __init__(self, name: str, url: str | None) -> None:
        assert url is not None
        self.name, self.url = name, url


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    p, d = FakeEngine("p0", block_size=4), FakeEngine("d1", block_size=4)
    await p.start()
    await d.start()
    yield p, d
    await p.close()
    await d.close()


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    client = EngineClient.for_settings(EngineSettings(first_token_timeout_s=2, decode_read_timeout_s=2))
    yield client
    await client.close()


async def _handoff(client: EngineClient, p: FakeEngine) -> object:
    return await client.prefill(Ref("p0", p.url), endpoints.COMPLETIONS, BODY, request_id="probe-x")


async def test_a_handoff_decoded_to_its_end_frees_the_producer(
    fleet: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = fleet
    result = await _handoff(client, p)
    done = await decode_to_end(client, result, Ref("d1", d.url), STREAM, deadline=1e12, max_age_s=10)  # type: ignore[arg-type]
    assert (done.error, done.handoff) == (None, "decoded") and p.kv.held_blocks == 0


async def test_a_handoff_its_consumer_never_received_is_given_back_through_another(
    fleet: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = fleet
    dead = DeadEngine(refusing=True)  # /health passed a moment ago; the decode's connect is refused
    try:
        result = await _handoff(client, p)
        assert p.kv.held_blocks > 0
        done = await decode_to_end(client, result, Ref("d0", dead.url), STREAM, deadline=1e12,  # type: ignore[arg-type]
                                   max_age_s=10, release_to=[Ref("d0", dead.url), Ref("d1", d.url)])
        assert done.error is not None and done.error.reason == "engine_unreachable"
        assert done.handoff == "released" and p.kv.held_blocks == 0
        again = await _handoff(client, p)
        left = await decode_to_end(client, again, Ref("d0", dead.url), STREAM, deadline=1e12,  # type: ignore[arg-type]
                                   max_age_s=10)
        assert left.handoff == "abandoned" and p.kv.held_blocks > 0  # nobody to give it to: the lease frees it
    finally:
        dead.close()


async def test_a_handoff_past_its_age_is_sent_nowhere(
    fleet: tuple[FakeEngine, FakeEngine], client: EngineClient
) -> None:
    p, d = fleet
    result = await _handoff(client, p)
    result.started_at -= 11  # type: ignore[attr-defined]  # a slow probe prefill: past max_age_s
    done = await decode_to_end(client, result, Ref("d1", d.url), STREAM, deadline=1e12, max_age_s=10,  # type: ignore[arg-type]
                               release_to=[Ref("d1", d.url)])
    assert done.error is not None and done.error.reason == "handoff_expired"
    assert done.handoff == "abandoned"
    assert d.get_records() == []  # neither decoded nor released: a late read is never made


@pytest.mark.parametrize(("frees", "fate"), [(False, "released"), (True, "received")])
async def test_a_probe_decode_refused_by_a_consumer_that_keeps_the_blocks_is_released(
    fleet: tuple[FakeEngine, FakeEngine], client: EngineClient, frees: bool, fate: str
) -> None:
    """A 4xx refusal by a consumer whose vLLM (below 0.21) leaves the producer's blocks pinned:
    the handoff is released (to it first); one that frees them itself gets no second word."""
    p, d = fleet
    d.set_faults({"decode": {"status": 400, "message": "refused", "streams_only": True}})
    result = await _handoff(client, p)
    done = await decode_to_end(client, result, Ref("d1", d.url), STREAM, deadline=1e12, max_age_s=10,  # type: ignore[arg-type]
                               frees_refused=lambda exc: frees)
    assert done.handoff == fate and done.error is not None and done.error.status == 400
    assert p.kv.held_blocks == 0  # released by the router, or freed by the consumer's own vLLM
