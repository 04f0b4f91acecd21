"""The real SDKs as clients of a real-gunicorn router and fake fleet (docs/behaviour.md "The other P/D endpoints"): the
``openai``
SDK streams a Responses call, the ``anthropic`` SDK streams a Messages call, and the Anthropic
SDK's ``x-api-key`` is a client key on /v1/messages that never reaches an engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import anthropic
import openai
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import ENGINES, MODEL, expected_text, records_anywhere, start_router


@pytest.fixture(scope="module")
def keyed_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engines = [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"}]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("keyed"), server={"api_keys": ["k-123"]})
    yield proc
    proc.stop()


def _openai_responses_stream(url: str, tag: str) -> tuple[list[str], str, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    types: list[str] = []
    text = ""
    status = ""
    with client.responses.create(model=MODEL, input=tag + " say something", max_output_tokens=6,
                                 stream=True) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                status = event.response.status or ""
    client.close()
    return types, text, status


async def test_the_openai_sdk_streams_a_responses_call(router: RouterProcess, fleet: FakeFleet) -> None:
    tag = uuid.uuid4().hex
    types, text, status = await asyncio.to_thread(_openai_responses_stream, router.url, tag)
    assert text == expected_text(6)
    assert types[0] == "response.created" and types[-1] == "response.incomplete"  # 0.33: max_output_tokens cut it
    assert status == "incomplete"  # max_output_tokens cut it, as vLLM reports
    phases = sorted(r["phase"] for recs in records_anywhere(fleet, tag, ENGINES).values() for r in recs)
    assert phases == ["decode", "prefill"]  # through P/D, not around it


def _anthropic_stream(url: str, key: str, tag: str) -> tuple[str, str | None, int]:
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=5, system="be brief",
                                messages=[{"role": "user", "content": tag + " hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    client.close()
    return text, final.stop_reason, final.usage.output_tokens


async def test_the_anthropic_sdk_streams_a_messages_call(router: RouterProcess) -> None:
    text, stop, output_tokens = await asyncio.to_thread(_anthropic_stream, router.url, "unused", uuid.uuid4().hex)
    assert text == expected_text(5)
    assert stop == "max_tokens" and output_tokens == 5


async def test_x_api_key_is_a_client_key_on_messages_and_never_reaches_an_engine(
    keyed_router: RouterProcess, fleet: FakeFleet
) -> None:
    tag = uuid.uuid4().hex
    text, _, _ = await asyncio.to_thread(_anthropic_stream, keyed_router.url, "k-123", tag)
    assert text == expected_text(5)
    legs = [r for recs in records_anywhere(fleet, tag, ENGINES).values() for r in recs]
    assert len(legs) == 2
    assert all("x-api-key" not in r["headers"] and "authorization" not in r["headers"] for r in legs)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await asyncio.to_thread(_anthropic_stream, keyed_router.url, "wrong", uuid.uuid4().hex)
    assert refused.value.status_code == 401
    assert refused.value.response.headers["x-narwhal-error"] == "unauthorized"
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "invalid or missing API key"}}
