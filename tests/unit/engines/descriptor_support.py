"""Shared by the descriptor tests: the client body, a valid NixlConnector descriptor, validation and
its rejection, edits."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.engines import endpoints
from narwhal.engines.connector import (
    InvalidHandoff,
    validate_descriptor,
)

CHAT = "/v1/chat/completions"


def decode_body(body: dict[str, Any], descriptor: dict[str, Any] | None) -> dict[str, Any]:
    """The completions dialect's decode body (the one every OpenAI endpoint's decode is built by)."""
    return endpoints.COMPLETIONS.dialect.decode_body(body, "rid", descriptor)
FOREIGN = ["transfer_id", "remote_bootstrap_addr", "first_tok", "disagg_spec", "ret_first_tok"]
COMPLETIONS = "/v1/completions"



def client_body() -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "min_tokens": 4,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "temperature": 0.7,
        "seed": 11,
    }


def valid_descriptor() -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "3f1c-engine",
        "remote_block_ids": [[0, 1, 2]],
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "remote_request_id": "cmpl-abc-0",
        "tp_size": 1,
    }


def validate(descriptor: Any, *, prefill_endpoint: str = CHAT, decode_endpoint: str = CHAT) -> dict[str, Any]:
    return validate_descriptor(
        descriptor, producer="p0", prefill_endpoint=prefill_endpoint, decode_endpoint=decode_endpoint
    )


def rejection(descriptor: Any, *, prefill_endpoint: str = CHAT, decode_endpoint: str = CHAT) -> str:
    with pytest.raises(InvalidHandoff) as info:
        validate(descriptor, prefill_endpoint=prefill_endpoint, decode_endpoint=decode_endpoint)
    return info.value.message


def with_(**changes: Any) -> dict[str, Any]:
    d = valid_descriptor()
    d.update(changes)
    return d


def without(*keys: str) -> dict[str, Any]:
    d = valid_descriptor()
    for key in keys:
        del d[key]
    return d
