"""The legs' bodies around a handoff (vLLM's sources): the prefill's, the decode's, the release's,
and the prefill result's descriptor copy."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from narwhal.engines import endpoints
from narwhal.engines.connector import (
    prefill_body,
    release_body,
)
from narwhal.engines.prefill_result import PrefillResult
from tests.unit.engines.descriptor_support import (
    client_body,
    decode_body,
    valid_descriptor,
)
from tests.wire import PREFILL_KV

# --------------------------------------------------------------------------- prefill body


# The client's body as a one-token, not streamed prefill; crossed, it asks for the handoff.
PREFILL = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": False,
    "max_tokens": 1,
    "temperature": 0.7,
    "seed": 11,
    "ignore_eos": True,
}


def test_prefill_body_crossed() -> None:
    assert prefill_body(client_body(), crossed=True) == {**PREFILL, "kv_transfer_params": PREFILL_KV}


def test_prefill_body_same_worker_has_no_kv_transfer_params() -> None:
    body = client_body()
    body["kv_transfer_params"] = {"remote_engine_id": "smuggled"}
    assert prefill_body(body, crossed=False) == PREFILL


def test_prefill_body_replaces_a_client_kv_transfer_params() -> None:
    body = client_body()
    body["kv_transfer_params"] = {"remote_engine_id": "smuggled", "do_remote_decode": False}
    assert prefill_body(body, crossed=True)["kv_transfer_params"] == PREFILL_KV


def test_prefill_body_max_completion_tokens_only_when_sent() -> None:
    body = client_body()
    assert "max_completion_tokens" not in prefill_body(body, crossed=True)
    body["max_completion_tokens"] = 500
    out = prefill_body(body, crossed=True)
    assert out["max_completion_tokens"] == 1
    assert out["max_tokens"] == 1


def test_prefill_body_without_max_tokens_still_gets_one() -> None:
    out = prefill_body({"model": "m", "prompt": "hi"}, crossed=True)
    assert out == {
        "model": "m",
        "prompt": "hi",
        "stream": False,
        "max_tokens": 1,
        "ignore_eos": True,
        "kv_transfer_params": PREFILL_KV,
    }


@pytest.mark.parametrize("crossed", [True, False])
def test_prefill_body_does_not_mutate_input(crossed: bool) -> None:
    body = client_body()
    body["max_completion_tokens"] = 9
    body["kv_transfer_params"] = {"x": 1}
    before = copy.deepcopy(body)
    prefill_body(body, crossed=crossed)
    assert body == before


def test_prefill_kv_params_are_fresh_per_call() -> None:
    first = prefill_body(client_body(), crossed=True)
    first["kv_transfer_params"]["remote_engine_id"] = "mutated"
    second = prefill_body(client_body(), crossed=True)
    assert second["kv_transfer_params"] == PREFILL_KV


# --------------------------------------------------------------------------- decode / release body


def test_decode_body_is_the_client_body_plus_the_descriptor_unchanged() -> None:
    body = client_body()
    before = copy.deepcopy(body)
    descriptor = valid_descriptor()
    out = decode_body(body, descriptor)
    assert out == {**before, "kv_transfer_params": valid_descriptor()}
    assert out["kv_transfer_params"] is descriptor
    assert body == before


def test_decode_body_same_worker_has_no_kv_transfer_params() -> None:
    body = client_body()
    body["kv_transfer_params"] = {"x": 1}
    out = decode_body(body, None)
    assert "kv_transfer_params" not in out
    assert out == client_body()
    assert body["kv_transfer_params"] == {"x": 1}


def test_release_body() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "temperature": 0.2,
    }
    before = copy.deepcopy(body)
    descriptor = valid_descriptor()
    out = release_body(body, descriptor)
    assert out == {
        "model": "m",
        "prompt": "hi",
        "stream": False,
        "max_tokens": 1,
        "temperature": 0.2,
        "kv_transfer_params": valid_descriptor(),
    }
    assert out["kv_transfer_params"] is descriptor
    assert body == before


def test_release_body_max_completion_tokens_only_when_sent() -> None:
    out = release_body({"model": "m", "messages": [], "max_completion_tokens": 80}, valid_descriptor())
    assert out["max_completion_tokens"] == 1
    assert out["max_tokens"] == 1
    assert "max_completion_tokens" not in release_body({"model": "m", "messages": []}, valid_descriptor())


def test_release_body_is_acceptable_with_client_min_tokens() -> None:
    # BUG (narwhal/engines/connector.py, release_body): the client's min_tokens is kept while
    # max_tokens becomes 1. vLLM refuses min_tokens > max_tokens with a 400 ("min_tokens must be
    # less than or equal to max_tokens=1") before queueing the request, so the release frees
    # nothing (docs/behaviour.md "Cleanup"). prefill_body drops min_tokens for the same reason.
    out = release_body(client_body(), valid_descriptor())
    assert out.get("min_tokens", 0) <= out["max_tokens"]


# --------------------------------------------------------------------------- PrefillResult


def make_result(descriptor: dict[str, Any] | None) -> PrefillResult:
    return PrefillResult(
        producer="p0", producer_url="http://p0", endpoint=endpoints.CHAT, request_id="rid-1", descriptor=descriptor
    )


def test_parameters_is_a_detached_deep_copy() -> None:
    descriptor = valid_descriptor()
    descriptor["future"] = {"nested": [1, 2]}
    result = make_result(descriptor)
    params = result.parameters()
    assert params == descriptor
    assert params is not descriptor
    params["remote_block_ids"][0].append(99)
    params["future"]["nested"].append(3)
    params["remote_host"] = "evil"
    del params["tp_size"]
    expected = valid_descriptor()
    expected["future"] = {"nested": [1, 2]}
    assert result.descriptor == expected
    assert result.parameters() == expected


def test_parameters_each_call_is_a_new_object() -> None:
    result = make_result(valid_descriptor())
    assert result.parameters() is not result.parameters()


def test_parameters_of_same_worker_result_is_none() -> None:
    assert make_result(None).parameters() is None


def test_a_release_body_carries_nothing_the_consumer_may_refuse() -> None:
    """``stop``, ``stop_token_ids`` and ``min_tokens`` (top-level, and in generate's
    ``sampling_params``) dropped: a release the consumer refuses frees nothing."""
    from narwhal.engines.endpoints import GENERATE

    body = {"model": "m", "prompt": "hi", "stop": ["x"], "stop_token_ids": [3], "min_tokens": 9, "max_tokens": 64}
    assert release_body(body, valid_descriptor()).keys() == {"model", "prompt", "stream", "max_tokens",
                                                              "kv_transfer_params"}
    generate = {"model": "m", "token_ids": [1], "sampling_params": {"max_tokens": 9, "stop": 5, "stop_token_ids": [1],
                                                                    "min_tokens": 3, "temperature": 0.5}}
    out = GENERATE.dialect.release_body(generate, "r", valid_descriptor())
    assert out["sampling_params"] == {"max_tokens": 1, "temperature": 0.5}
