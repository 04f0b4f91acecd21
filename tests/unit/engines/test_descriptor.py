"""The KV handoff descriptor's validation (docs/behaviour.md "Handoff validation", NixlConnector format): what is
accepted as
is, what is refused and why, in which order the rules apply."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from narwhal.engines.connector import (
    InvalidHandoff,
)
from narwhal.errors import EngineError
from tests.unit.engines.descriptor_support import (
    CHAT,
    COMPLETIONS,
    FOREIGN,
    rejection,
    valid_descriptor,
    validate,
    with_,
    without,
)

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
