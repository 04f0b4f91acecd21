"""The KV handoff: prefill/decode/release bodies and descriptor validation (SPEC §3 steps 3–6, 8)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from narwhal.engines import endpoints
from narwhal.engines.connector import (
    InvalidHandoff,
    PrefillResult,
    prefill_body,
    release_body,
    validate_descriptor,
)
from narwhal.errors import EngineError

CHAT = "/v1/chat/completions"


def decode_body(body: dict[str, Any], descriptor: dict[str, Any] | None) -> dict[str, Any]:
    """The completions dialect's decode body (the one every OpenAI endpoint's decode is built by)."""
    return endpoints.COMPLETIONS.dialect.decode_body(body, "rid", descriptor)
FOREIGN = ["transfer_id", "remote_bootstrap_addr", "first_tok", "disagg_spec", "ret_first_tok"]
COMPLETIONS = "/v1/completions"

PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


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


# --------------------------------------------------------------------------- prefill body


def test_prefill_body_crossed() -> None:
    assert prefill_body(client_body(), crossed=True) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "temperature": 0.7,
        "seed": 11,
        "ignore_eos": True,
        "kv_transfer_params": PREFILL_KV,
    }


def test_prefill_body_same_worker_has_no_kv_transfer_params() -> None:
    body = client_body()
    body["kv_transfer_params"] = {"remote_engine_id": "smuggled"}
    assert prefill_body(body, crossed=False) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "temperature": 0.7,
        "seed": 11,
        "ignore_eos": True,
    }


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
    # nothing (SPEC §3 step 8). prefill_body drops min_tokens for the same reason.
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


# --------------------------------------------------------------------------- validation: accepted


@pytest.mark.parametrize(
    "descriptor",
    [
        valid_descriptor(),
        with_(remote_block_ids=[]),
        with_(remote_block_ids=[0, 1, 2, 7]),
        with_(remote_block_ids=[[0, 1], [2, 3]]),
        with_(remote_block_ids=[[1, 2], []]),
        with_(remote_block_ids=[[]]),
        with_(remote_port=1),
        with_(remote_port=65535),
        with_(remote_request_id=None),
        without("remote_request_id"),
    ],
    ids=[
        "full",
        "empty-blocks",
        "flat-blocks",
        "grouped-blocks",
        "group-empty",
        "one-empty-group",
        "port-1",
        "port-65535",
        "request-id-null",
        "request-id-absent",
    ],
)
def test_valid_descriptor_returned_as_is(descriptor: dict[str, Any]) -> None:
    snapshot = copy.deepcopy(descriptor)
    assert validate(descriptor) is descriptor
    assert descriptor == snapshot


def test_opaque_keys_are_kept_unchanged() -> None:
    descriptor = with_(
        tp_size=4,
        dcp_size=2,
        remote_num_tokens=37,
        transfer_mode="read",
        x_future_connector_field={"lease_s": 30, "ranks": [0, 1]},
    )
    snapshot = copy.deepcopy(descriptor)
    out = validate(descriptor)
    assert out is descriptor
    assert out == snapshot
    assert list(out) == list(snapshot)  # same keys, same order
    assert out["x_future_connector_field"] is descriptor["x_future_connector_field"]


# --------------------------------------------------------------------------- validation: rejected


def test_invalid_handoff_error_shape() -> None:
    with pytest.raises(InvalidHandoff) as info:
        validate(None)
    exc = info.value
    assert isinstance(exc, EngineError)
    assert exc.reason == "invalid_handoff"
    assert exc.status == 502
    assert exc.message == "invalid handoff: missing engine identity"
    assert str(exc) == "invalid handoff: missing engine identity"
    assert exc.engine == "p0"
    assert exc.phase == "prefill"
    assert exc.counts is True


@pytest.mark.parametrize("key", FOREIGN)
def test_foreign_connector_key(key: str) -> None:
    assert rejection(with_(**{key: "x"})) == "invalid handoff: connector mismatch"


@pytest.mark.parametrize("key", FOREIGN)
def test_foreign_connector_key_alone(key: str) -> None:
    assert rejection({key: 1}) == "invalid handoff: connector mismatch"


@pytest.mark.parametrize(
    "descriptor",
    [
        None,
        {},
        without("remote_engine_id"),
        with_(remote_engine_id=None),
        with_(remote_engine_id=""),
        [],
        "descriptor",
    ],
    ids=["null", "empty-object", "absent", "engine-null", "engine-empty", "list", "string"],
)
def test_missing_engine_identity(descriptor: Any) -> None:
    assert rejection(descriptor) == "invalid handoff: missing engine identity"


@pytest.mark.parametrize(
    "block_ids",
    [
        None,
        "0,1,2",
        5,
        {"0": [1]},
        [True],
        [False, 1],
        [[1, True]],
        [-1],
        [0, -2],
        [[1], [-1]],
        ["1"],
        [["1", "2"]],
        [1.0],
        [[1.5]],
        [1, [2]],
        [[1], 2],
        [[[1]]],
        [None],
    ],
)
def test_malformed_block_ids(block_ids: Any) -> None:
    assert rejection(with_(remote_block_ids=block_ids)) == "invalid handoff: malformed block IDs"


def test_missing_block_ids() -> None:
    assert rejection(without("remote_block_ids")) == "invalid handoff: malformed block IDs"


@pytest.mark.parametrize("host", ["", None, 5, ["10.0.0.5"], b"10.0.0.5"])
def test_malformed_remote_host(host: Any) -> None:
    assert rejection(with_(remote_host=host)) == "invalid handoff: malformed field remote_host"


def test_missing_remote_host() -> None:
    assert rejection(without("remote_host")) == "invalid handoff: malformed field remote_host"


@pytest.mark.parametrize("port", [True, False, 0, -1, 65536, "5600", None, 5600.0])
def test_malformed_remote_port(port: Any) -> None:
    assert rejection(with_(remote_port=port)) == "invalid handoff: malformed field remote_port"


def test_missing_remote_port() -> None:
    assert rejection(without("remote_port")) == "invalid handoff: malformed field remote_port"


@pytest.mark.parametrize("rid", ["", 5, ["x"], True])
def test_malformed_remote_request_id(rid: Any) -> None:
    assert rejection(with_(remote_request_id=rid)) == "invalid handoff: malformed field remote_request_id"


def test_endpoint_mismatch() -> None:
    assert (
        rejection(valid_descriptor(), prefill_endpoint=COMPLETIONS, decode_endpoint=CHAT)
        == "invalid handoff: endpoint mismatch"
    )
    assert validate(valid_descriptor(), prefill_endpoint=COMPLETIONS, decode_endpoint=COMPLETIONS) is not None


# --------------------------------------------------------------------------- rule order


@pytest.mark.parametrize(
    ("descriptor", "prefill_endpoint", "detail"),
    [
        # connector mismatch beats everything after it
        (
            {"transfer_id": "t", "remote_block_ids": "bad", "remote_host": "", "remote_port": 0},
            COMPLETIONS,
            "invalid handoff: connector mismatch",
        ),
        (with_(first_tok=3, remote_engine_id=None), CHAT, "invalid handoff: connector mismatch"),
        # missing identity beats block ids, fields and endpoint
        (
            {"remote_engine_id": "", "remote_block_ids": [-1], "remote_host": "", "remote_port": 0},
            COMPLETIONS,
            "invalid handoff: missing engine identity",
        ),
        # block ids beat fields and endpoint
        (
            with_(remote_block_ids=[True], remote_host="", remote_port=0, remote_request_id=""),
            COMPLETIONS,
            "invalid handoff: malformed block IDs",
        ),
        # fields, in the order host, port, request id, beat endpoint
        (
            with_(remote_host="", remote_port=0, remote_request_id=""),
            COMPLETIONS,
            "invalid handoff: malformed field remote_host",
        ),
        (
            with_(remote_port=0, remote_request_id=""),
            COMPLETIONS,
            "invalid handoff: malformed field remote_port",
        ),
        (with_(remote_request_id=""), COMPLETIONS, "invalid handoff: malformed field remote_request_id"),
        # endpoint last
        (valid_descriptor(), COMPLETIONS, "invalid handoff: endpoint mismatch"),
    ],
)
def test_rule_order(descriptor: dict[str, Any], prefill_endpoint: str, detail: str) -> None:
    assert rejection(descriptor, prefill_endpoint=prefill_endpoint, decode_endpoint=CHAT) == detail


def test_the_tensor_parallel_rule_is_vllms_multiple_rule() -> None:
    # vLLM 0.11's NixlConnector: each consumer rank reads one producer rank's share of the heads.
    from narwhal.engines.connector import tp_accepted, tp_size_of

    accepted = {(p, d) for p in (1, 2, 4) for d in (1, 2, 3, 4, 8) if tp_accepted(p, d)}
    assert accepted == {(1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8)}
    assert [tp_size_of(d) for d in ({"tp_size": 2}, {"tp_size": True}, {"tp_size": 0}, {}, None)] == [
        2, None, None, None, None]
