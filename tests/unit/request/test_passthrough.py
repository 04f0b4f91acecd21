"""Admission of a passthrough body (docs/behaviour.md "Passthrough routes"; ``admission.admit`` takes
it through ``parse_passthrough``): parsed once, transfer params dropped, the model resolved.
"""

from __future__ import annotations

import orjson
import pytest

from narwhal.errors import RequestError
from narwhal.fleet import Fleet
from narwhal.request.admission import parse_passthrough as parse_body
from narwhal.settings import Settings


def _fleet(*models: list[str]) -> Fleet:
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{9100 + i}", "role": "both", "models": m}
               for i, m in enumerate(models)]
    return Fleet(Settings(engines=engines))


def test_body_kept_but_for_transfer_params() -> None:
    raw = orjson.dumps({"model": "m", "input": ["a"], "kv_transfer_params": {"do_remote_prefill": True}, "x": 1})
    assert parse_body(raw, _fleet(["m"])) == ({"model": "m", "input": ["a"], "x": 1}, "m")


def test_a_duplicate_key_cannot_smuggle_transfer_params() -> None:
    raw = b'{"model": "m", "kv_transfer_params": {"a": 1}, "kv_transfer_params": {"b": 2}}'
    assert parse_body(raw, _fleet(["m"])) == ({"model": "m"}, "m")


def test_the_only_served_model_when_none_is_named() -> None:
    assert parse_body(b'{"prompt": "x"}', _fleet(["m"], ["m"])) == ({"prompt": "x"}, "m")


@pytest.mark.parametrize(
    ("raw", "reason", "message"),
    [
        (b'{"prompt": "x"}', "bad_request", "'model' is required"),
        (b'{"model": 3}', "bad_request", "'model' must be a string"),
        (b'{"model": "zz"}', "model_not_found", "The model `zz` does not exist."),
        (b"[1]", "bad_request", "the request body must be a JSON object"),
    ],
)
def test_refusals(raw: bytes, reason: str, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_body(raw, _fleet(["m"], ["n"]))
    assert (caught.value.reason, caught.value.message) == (reason, message)
