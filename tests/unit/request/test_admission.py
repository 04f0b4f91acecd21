"""Admission: parse the body once, refuse what the router cannot honour (docs/behaviour.md "Admission").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal.engines.endpoints import CHAT, COMPLETIONS, Endpoint
from narwhal.errors import RequestError
from narwhal.fleet import Fleet
from narwhal.request.admission import parse
from narwhal.settings import load_settings

FLEET_TOML = """
[[engines]]
name = "p0"
url = "http://10.0.0.5:8100"
role = "producer"
models = ["m"]

[[engines]]
name = "d0"
url = "http://10.0.0.6:8200"
role = "consumer"
models = ["m"]
"""


def make_fleet(directory: Path, toml: str) -> Fleet:
    path = directory / "fleet.toml"
    path.write_text(toml)
    return Fleet(load_settings(str(path), environ={}))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return make_fleet(tmp_path_factory.mktemp("fleet"), FLEET_TOML)


@pytest.fixture(scope="module")
def two_model_fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    toml = FLEET_TOML.replace('models = ["m"]', 'models = ["m", "m2"]')
    return make_fleet(tmp_path_factory.mktemp("fleet2"), toml)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **extra}


def refused(raw: bytes, endpoint: Endpoint, fleet: Fleet) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(raw, endpoint, fleet)
    return info.value


def assert_bad_request(raw: bytes, endpoint: Endpoint, fleet: Fleet, message: str) -> None:
    err = refused(raw, endpoint, fleet)
    assert (err.reason, err.status, err.message) == ("bad_request", 400, message)


# --------------------------------------------------------------------------- accepted


def test_chat_body_is_parsed(fleet: Fleet) -> None:
    body = chat_body(stream=True, max_tokens=8, temperature=0.5)
    assert parse(orjson.dumps(body), CHAT, fleet) == (body, "m", True)


def test_completion_body_is_parsed(fleet: Fleet) -> None:
    body = completion_body(max_tokens=0)
    assert parse(orjson.dumps(body), COMPLETIONS, fleet) == (body, "m", False)


@pytest.mark.parametrize("stream", [False, None])
def test_stream_false_or_null(fleet: Fleet, stream: bool | None) -> None:
    body = completion_body(stream=stream)
    assert parse(orjson.dumps(body), COMPLETIONS, fleet) == (body, "m", False)


@pytest.mark.parametrize(
    "prompt",
    ["", "hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [[0]]],
)
def test_valid_prompts(fleet: Fleet, prompt: Any) -> None:
    body = completion_body(prompt=prompt)
    assert parse(orjson.dumps(body), COMPLETIONS, fleet) == (body, "m", False)


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 1},
        {"best_of": 1},
        {"n": None},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": None},
        {"max_tokens": None},
        {"max_completion_tokens": 0},
        {"stream_options": {}},  # vLLM refuses only truthy options without stream (below)
        {"stream_options": None},
    ],
    ids=lambda e: repr(e),
)
def test_accepted_optional_fields(fleet: Fleet, extra: dict[str, Any]) -> None:
    body = chat_body(**extra)
    assert parse(orjson.dumps(body), CHAT, fleet) == (body, "m", False)


def test_stream_options_need_a_stream_as_vllm_validates_them(fleet: Fleet) -> None:
    assert parse(orjson.dumps(chat_body(stream=True, stream_options={"include_usage": True})), CHAT, fleet)[2]
    for stream in ({}, {"stream": False}):
        with pytest.raises(RequestError) as refused:
            parse(orjson.dumps(chat_body(**stream, stream_options={"include_usage": True})), CHAT, fleet)
        assert refused.value.message == "Stream options can only be defined when `stream=True`."
        assert refused.value.param == "stream_options" and refused.value.status == 400


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"stop_token_ids": "7"}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "2"}, "min_tokens"),
])
def test_fields_the_prefill_drops_are_refused_before_any_prefill(
    fleet: Fleet, extra: dict[str, Any], param: str
) -> None:
    # The producer never sees them: only the consumer would refuse them, with a validation 400
    # that leaves the handoff pinned (docs/behaviour.md, "A consumer's refusal").
    with pytest.raises(RequestError) as refused:
        parse(orjson.dumps(chat_body(**extra)), CHAT, fleet)
    assert refused.value.param == param and refused.value.status == 400
    assert orjson.loads(COMPLETIONS.dialect.error_body(refused.value))["error"]["param"] == param


def test_unknown_fields_pass_through_untouched(fleet: Fleet) -> None:
    body = chat_body(
        top_k=5, guided_json={"type": "object"}, logit_bias={"1": -100}, future_knob=[1, {"a": None}]
    )
    assert parse(orjson.dumps(body), CHAT, fleet)[0] == body


def test_missing_model_with_single_served_model(fleet: Fleet) -> None:
    raw = orjson.dumps({"prompt": "hi"})
    assert parse(raw, COMPLETIONS, fleet) == ({"prompt": "hi"}, "m", False)


def test_missing_model_with_several_served_models(two_model_fleet: Fleet) -> None:
    assert_bad_request(orjson.dumps({"prompt": "hi"}), COMPLETIONS, two_model_fleet, "'model' is required")


def test_second_model_served(two_model_fleet: Fleet) -> None:
    body = completion_body(model="m2")
    assert parse(orjson.dumps(body), COMPLETIONS, two_model_fleet) == (body, "m2", False)


# --------------------------------------------------------------------------- kv_transfer_params


@pytest.mark.parametrize("value", [{}, {"remote_engine_id": "x", "remote_block_ids": [1]}, None, "x"])
def test_client_kv_transfer_params_removed(fleet: Fleet, value: Any) -> None:
    body, model, stream = parse(orjson.dumps(chat_body(kv_transfer_params=value)), CHAT, fleet)
    assert body == chat_body()
    assert "kv_transfer_params" not in body


def test_duplicate_kv_transfer_params_key_never_survives(fleet: Fleet) -> None:
    raw = (
        b'{"model":"m","kv_transfer_params":{},"kv_transfer_params":{"x":1},'
        b'"messages":[{"role":"user","content":"hi"}]}'
    )
    body, model, stream = parse(raw, CHAT, fleet)
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (model, stream) == ("m", False)


def test_duplicate_kv_transfer_params_reversed_order(fleet: Fleet) -> None:
    raw = (
        b'{"kv_transfer_params":{"remote_engine_id":"e"},"model":"m","prompt":"p",'
        b'"kv_transfer_params":null}'
    )
    body, _, _ = parse(raw, COMPLETIONS, fleet)
    assert body == {"model": "m", "prompt": "p"}


# --------------------------------------------------------------------------- not JSON / not an object


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b'{"model": "m",}', b"nope", b"{'model': 'm'}", b'{"a": NaN}'],
    ids=["empty", "truncated", "trailing-comma", "bare-word", "single-quotes", "nan"],
)
def test_invalid_json(fleet: Fleet, raw: bytes) -> None:
    err = refused(raw, CHAT, fleet)
    assert (err.reason, err.status) == ("bad_request", 400)
    assert err.message.startswith("invalid JSON body: ")


@pytest.mark.parametrize(
    "raw",
    [b'{"model":"m","prompt":"\xff\xfe"}', b'{"model":"m","prompt":"caf\xc3"}', b"\xff"],
    ids=["ff-fe", "truncated-sequence", "lone-byte"],
)
def test_invalid_utf8(fleet: Fleet, raw: bytes) -> None:
    err = refused(raw, COMPLETIONS, fleet)
    assert (err.reason, err.status) == ("bad_request", 400)
    assert err.message.startswith("invalid JSON body: ")


@pytest.mark.parametrize("raw", [b"[]", b'[{"model":"m"}]', b'"hello"', b"42", b"1.5", b"null", b"true"])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_not_an_object(fleet: Fleet, raw: bytes, endpoint: Endpoint) -> None:
    assert_bad_request(raw, endpoint, fleet, "the request body must be a JSON object")


# --------------------------------------------------------------------------- required fields


def test_chat_without_messages(fleet: Fleet) -> None:
    assert_bad_request(orjson.dumps({"model": "m"}), CHAT, fleet, "'messages' must be a list of objects")


def test_completion_without_prompt(fleet: Fleet) -> None:
    assert_bad_request(orjson.dumps({"model": "m"}), COMPLETIONS, fleet, "'prompt' is required")


def test_completion_with_messages_but_no_prompt(fleet: Fleet) -> None:
    assert_bad_request(orjson.dumps(chat_body()), COMPLETIONS, fleet, "'prompt' is required")


# --------------------------------------------------------------------------- wrong types

PROMPT_MESSAGE = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of ids"


@pytest.mark.parametrize(
    ("endpoint", "body", "message"),
    [
        (CHAT, chat_body(model=5), "'model' must be a string"),
        (CHAT, chat_body(model=["m"]), "'model' must be a string"),
        (CHAT, chat_body(stream="yes"), "'stream' must be a boolean"),
        (CHAT, chat_body(stream=1), "'stream' must be a boolean"),
        (CHAT, chat_body(stream=0), "'stream' must be a boolean"),
        (COMPLETIONS, completion_body(stream="true"), "'stream' must be a boolean"),
        (CHAT, chat_body(max_tokens=-1), "'max_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_tokens="5"), "'max_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_tokens=True), "'max_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_tokens=1.5), "'max_tokens' must be an integer >= 0"),
        (COMPLETIONS, completion_body(max_tokens=-1), "'max_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_completion_tokens=-1), "'max_completion_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_completion_tokens="5"), "'max_completion_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_completion_tokens=True), "'max_completion_tokens' must be an integer >= 0"),
        (CHAT, chat_body(max_completion_tokens=1.5), "'max_completion_tokens' must be an integer >= 0"),
        (CHAT, chat_body(messages={"role": "user", "content": "hi"}), "'messages' must be a list of objects"),
        (CHAT, chat_body(messages=["hi", "there"]), "'messages' must be a list of objects"),
        (
            CHAT,
            chat_body(messages=[{"role": "user", "content": "hi"}, "x"]),
            "'messages' must be a list of objects",
        ),
        (CHAT, chat_body(messages="hi"), "'messages' must be a list of objects"),
        (CHAT, chat_body(messages=None), "'messages' must be a list of objects"),
        (COMPLETIONS, completion_body(prompt={"text": "hi"}), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=["a", 1]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=[1, [2]]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=[[1, "a"]]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=[[1, 2.5]]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=[[1, [2]]]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=[[True]]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=[1, True]), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=5), PROMPT_MESSAGE),
        (COMPLETIONS, completion_body(prompt=None), PROMPT_MESSAGE),
        (CHAT, chat_body(stream_options=[]), "'stream_options' must be an object"),
        (CHAT, chat_body(stream_options=["include_usage"]), "'stream_options' must be an object"),
        (COMPLETIONS, completion_body(stream_options="include_usage"), "'stream_options' must be an object"),
    ],
)
def test_wrong_types(fleet: Fleet, endpoint: Endpoint, body: dict[str, Any], message: str) -> None:
    assert_bad_request(orjson.dumps(body), endpoint, fleet, message)


# --------------------------------------------------------------------------- not for disaggregation


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"n": 2}, "'n' > 1 is not supported by disaggregated serving"),
        ({"n": 8}, "'n' > 1 is not supported by disaggregated serving"),
        ({"best_of": 2}, "'best_of' > 1 is not supported by disaggregated serving"),
        ({"prompt_logprobs": 1}, "'prompt_logprobs' is not supported by disaggregated serving"),
        ({"prompt_logprobs": 5}, "'prompt_logprobs' is not supported by disaggregated serving"),
    ],
)
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_unsupported_parameters(fleet: Fleet, extra: dict[str, Any], message: str, endpoint: Endpoint) -> None:
    body = chat_body(**extra) if endpoint == CHAT else completion_body(**extra)
    assert_bad_request(orjson.dumps(body), endpoint, fleet, message)


# --------------------------------------------------------------------------- unknown model


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_unknown_model(fleet: Fleet, endpoint: Endpoint) -> None:
    body = chat_body(model="gpt-17") if endpoint == CHAT else completion_body(model="gpt-17")
    err = refused(orjson.dumps(body), endpoint, fleet)
    assert (err.reason, err.status) == ("model_not_found", 404)
    assert err.message == "The model `gpt-17` does not exist."


def test_unknown_model_error_body(fleet: Fleet) -> None:
    err = refused(orjson.dumps(completion_body(model="x")), COMPLETIONS, fleet)
    assert orjson.loads(COMPLETIONS.dialect.error_body(err)) == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "model_not_found",
            "param": None,
            "code": 404,
        }
    }
    assert err.headers() == {"x-narwhal-error": "model_not_found"}


def test_bad_request_error_body(fleet: Fleet) -> None:
    err = refused(b"[]", CHAT, fleet)
    assert orjson.loads(COMPLETIONS.dialect.error_body(err)) == {
        "error": {
            "message": "the request body must be a JSON object",
            "type": "bad_request",
            "param": None,
            "code": 400,
        }
    }
    assert err.headers() == {"x-narwhal-error": "bad_request"}


# --------------------------------------------------------------------------- the model's context


def test_a_limit_above_the_smallest_context_is_refused_with_vllms_message(tmp_path: Path) -> None:
    fleet = make_fleet(tmp_path, FLEET_TOML)
    fleet.set_context(fleet.by_name["p0"], 2048)
    fleet.set_context(fleet.by_name["d0"], 1024)
    for body, endpoint in ((completion_body(max_tokens=1524), COMPLETIONS), (chat_body(max_tokens=1524), CHAT),
                           (chat_body(max_tokens=10, max_completion_tokens=1524), CHAT)):
        error = refused(orjson.dumps(body), endpoint, fleet)
        assert str(error) == ("max_tokens=1524 cannot be greater than max_model_len=1024. Please request fewer "
                              "output tokens. (parameter=max_tokens, value=1524)")
        assert error.param == "max_tokens" and error.status == 400
    assert parse(orjson.dumps(completion_body(max_tokens=1024)), COMPLETIONS, fleet)[0]["max_tokens"] == 1024
    fleet.set_context(fleet.by_name["d0"], None)
    assert parse(orjson.dumps(completion_body(max_tokens=1524)), COMPLETIONS, fleet)[0]["max_tokens"] == 1524


def test_a_client_handoff_in_vllm_xargs_is_removed(fleet: Fleet) -> None:
    body, _, _ = parse(orjson.dumps(chat_body(vllm_xargs={"kv_transfer_params": "x", "keep": 1})), CHAT, fleet)
    assert body["vllm_xargs"] == {"keep": 1}


@pytest.mark.parametrize(("params", "message", "param"), [
    ({"max_tokens": 4, "stop": 5}, "'sampling_params.stop' must be a string or a list of strings",
     "sampling_params.stop"),
    ({"max_tokens": 4, "stop_token_ids": ["a"]}, "'sampling_params.stop_token_ids' must be a list of integers",
     "sampling_params.stop_token_ids"),
    ({"max_tokens": 4, "min_tokens": -1}, "'sampling_params.min_tokens' must be an integer >= 0",
     "sampling_params.min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be less than or equal to max_tokens=4, got 5.",
     "sampling_params.min_tokens"),
])
def test_generate_sampling_fields_only_the_consumer_sees_are_checked_at_admission(
    fleet: Fleet, params: dict[str, Any], message: str, param: str
) -> None:
    from narwhal.engines.endpoints import GENERATE

    body = {"model": "m", "token_ids": [1, 2], "sampling_params": params}
    error = refused(orjson.dumps(body), GENERATE, fleet)
    assert (str(error), error.param) == (message, param)
