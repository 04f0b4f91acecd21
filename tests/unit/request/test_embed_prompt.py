"""The prompt encoded once and embedded in every engine body: the bytes each leg sends are the same."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from narwhal.engines import endpoints
from narwhal.request.admission import embed_prompt

LONG = "You are a careful assistant. " * 100  # ~3 KiB: over the embedding threshold
DESCRIPTOR = {"remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 5600}
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "m", "prompt": LONG, "stream": True, "max_tokens": 4,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "system", "content": LONG},
                                                         {"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/messages", {"model": "m", "system": LONG, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "stream": True}),
    ("/v1/responses", {"model": "m", "instructions": LONG, "input": "hi", "stream": True}),
    ("/inference/v1/generate", {"model": "m", "token_ids": list(range(50)), "sampling_params": {"max_tokens": 4}}),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_every_leg_sends_the_same_bytes_with_the_prompt_embedded(path: str, body: dict[str, Any]) -> None:
    dialect = endpoints.BY_PATH[path].dialect
    embedded = copy.deepcopy(body)
    embed_prompt(embedded, dialect.prompt_fields)
    assert any(isinstance(embedded.get(k), orjson.Fragment) for k in dialect.prompt_fields)
    for crossed in (True, False):
        assert orjson.dumps(dialect.prefill_body(embedded, "r", crossed)) == orjson.dumps(
            dialect.prefill_body(body, "r", crossed))
    for descriptor in (DESCRIPTOR, None):
        assert orjson.dumps(dialect.decode_body(embedded, "r", descriptor)) == orjson.dumps(
            dialect.decode_body(body, "r", descriptor))
    assert orjson.dumps(dialect.release_body(embedded, "r", DESCRIPTOR)) == orjson.dumps(
        dialect.release_body(body, "r", DESCRIPTOR))


def test_a_short_prompt_string_is_left_as_it_is() -> None:
    body = {"model": "m", "prompt": "hello"}
    embed_prompt(body, ("prompt",))
    assert body == {"model": "m", "prompt": "hello"}
