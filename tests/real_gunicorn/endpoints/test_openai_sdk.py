"""The official ``openai`` Python client, streaming and not, through the router."""

from __future__ import annotations

import pytest
from openai import APIStatusError, AsyncOpenAI

from narwhal.testing.harness import RouterProcess
from tests.real_gunicorn.support import MODEL, expected_text, unique_prompt


def client(router: RouterProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=20)


async def test_openai_sdk_streams_chat(router: RouterProcess) -> None:
    async with client(router) as sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": unique_prompt()}], stream=True, max_tokens=5
        )
        text = ""
        finish = None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    assert text == expected_text(5)
    assert finish == "length"


async def test_openai_sdk_streams_completions(router: RouterProcess) -> None:
    async with client(router) as sdk:
        stream = await sdk.completions.create(model=MODEL, prompt=unique_prompt(), stream=True, max_tokens=7)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == expected_text(7)


async def test_openai_sdk_non_streaming_chat(router: RouterProcess) -> None:
    async with client(router) as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": unique_prompt()}], max_tokens=3
        )
    assert reply.choices[0].message.content == expected_text(3)


async def test_openai_sdk_sees_router_errors_in_its_own_shape(router: RouterProcess) -> None:
    async with client(router) as sdk:
        with pytest.raises(APIStatusError) as info:
            await sdk.completions.create(model="no-such-model", prompt="x", max_tokens=3)
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "model_not_found",
        "param": None,
        "code": 404,
    }
