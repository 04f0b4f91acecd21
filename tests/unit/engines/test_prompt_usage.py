"""Each P/D endpoint's prefill usage, read in its own field names (docs/behaviour.md "Placement" source 2)."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.engines import endpoints

CASES: list[tuple[str, Any, tuple[int | None, int | None]]] = [
    ("/v1/completions", {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}, (90, 64)),
    ("/v1/chat/completions", {"prompt_tokens": 90, "prompt_tokens_details": None}, (90, None)),
    ("/v1/completions", {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": False}}, (None, None)),
    ("/v1/responses", {"input_tokens": 90, "input_tokens_details": {"cached_tokens": 64}}, (90, 64)),
    ("/v1/responses", {"input_tokens": 90, "input_tokens_details": {"cached_tokens": 0}}, (90, 0)),
    ("/v1/responses", {"prompt_tokens": 90}, (None, None)),
    # Anthropic's input_tokens are the uncached rest: the prompt is the sum.
    ("/v1/messages", {"input_tokens": 26, "output_tokens": 1, "cache_read_input_tokens": 64}, (90, 64)),
    ("/v1/messages", {"input_tokens": 90, "output_tokens": 1}, (90, None)),
    ("/v1/messages", {"input_tokens": 10, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 16}, (90, 64)),
    ("/v1/messages", {"input_tokens": "90"}, (None, None)),
    # Three counts each below 2^32 whose sum is not: the prompt is unknown, the cached part stays.
    ("/v1/messages", {"input_tokens": 2**31, "cache_read_input_tokens": 2**31, "cache_creation_input_tokens": 0},
     (None, 2**31)),
    ("/inference/v1/generate", None, (None, None)),
]


@pytest.mark.parametrize(("endpoint", "usage", "expected"), CASES)
def test_prompt_usage_in_each_endpoints_fields(
    endpoint: str, usage: Any, expected: tuple[int | None, int | None]
) -> None:
    assert endpoints.BY_PATH[endpoint].dialect.prompt_usage(usage) == expected
