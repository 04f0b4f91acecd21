"""Nothing an engine sends may raise out of the parsers that read it: a number
out of range, a wrong type or a huge value is *unknown*, never an exception that could stop a
loop (the supervisor's load reads, a worker's metric flush, the request path). Property tests
over arbitrary bodies, each parser with its declared outcome."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engines import endpoints, sse
from narwhal.engines.connector import InvalidHandoff, validate_descriptor
from narwhal.engines.control import parse_models, parse_version
from narwhal.request.usage import completion_tokens
from narwhal.supervisor.load_metrics import parse_capacity, parse_load, parse_prefill

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
KEYS = st.sampled_from(["remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                        "remote_prefill_cached_tokens", "remote_num_tokens", "prompt_tokens", "cached_tokens",
                        "usage", "prompt_tokens_details", "input_tokens", "completion_tokens", "version", "data"])
SHAPED = st.dictionaries(KEYS, JSON, max_size=8)  # bodies with the keys the parsers look for
NUMBER = st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=5) | st.none()
USAGE = st.fixed_dictionaries({}, optional={
    "prompt_tokens": NUMBER, "input_tokens": NUMBER, "cache_read_input_tokens": NUMBER,
    "prompt_tokens_details": st.fixed_dictionaries({}, optional={"cached_tokens": NUMBER}) | NUMBER,
    "input_tokens_details": st.fixed_dictionaries({}, optional={"cached_tokens": NUMBER}) | NUMBER,
})
METRIC_LINE = st.builds(
    lambda name, labels, value: f"{name}{{{labels}}} {value}\n",
    st.sampled_from(["vllm:cache_config_info", "vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                     "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"]),
    st.lists(st.builds(lambda k, v: f'{k}="{v}"',
                       st.sampled_from(["block_size", "num_gpu_blocks", "kv_cache_size_tokens", "engine",
                                        "hash_block_size", "model_name"]),
                       st.text(alphabet="0123456789-.eNoa", max_size=40) | st.just("9" * 5000)),
             max_size=5).map(",".join),
    st.text(alphabet="0123456789-.e+Naif", max_size=30),
)
METRICS = st.lists(METRIC_LINE, max_size=8).map("".join) | st.binary(max_size=300).map(
    lambda b: b.decode("latin-1"))


@settings(max_examples=300, deadline=None)
@given(METRICS)
def test_metrics_bodies_give_a_reading_or_none(text: str) -> None:
    for body in (text, text.encode("utf-8", "surrogatepass")):
        capacity = parse_capacity(body)
        assert capacity is None or (type(capacity) is int and 0 < capacity < 10**16)
        parse_load(body)
        parse_prefill(body)


@settings(max_examples=300, deadline=None)
@given(SHAPED | JSON | USAGE.map(lambda usage: {"usage": usage}))
def test_answers_give_usage_versions_and_models_or_unknown(obj: Any) -> None:
    raw = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) if _encodable(obj) else b"{"
    parse_version(raw)
    parse_models(raw)
    for endpoint in endpoints.PD_ENDPOINTS:
        prompt, cached = endpoint.dialect.prompt_usage(obj.get("usage") if isinstance(obj, dict) else obj)
        for value in (prompt, cached):
            assert value is None or (type(value) is int and 0 <= value < 2**32), (endpoint.path, value)
    tokens = completion_tokens(raw)
    assert tokens is None or 0 <= tokens < 10**16


@settings(max_examples=300, deadline=None)
@given(SHAPED | JSON)
def test_a_descriptor_is_valid_or_an_invalid_handoff(obj: Any) -> None:
    try:
        validate_descriptor(obj, producer="p0", prefill_endpoint="/v1/completions", decode_endpoint="/v1/completions")
    except InvalidHandoff:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_stream_bytes_are_framed_and_classified_without_raising(chunks: list[bytes]) -> None:
    framer = sse.SSEFramer()
    for chunk in chunks:
        try:
            events = framer.feed(chunk)
        except sse.EventTooLarge:
            return
        for event in sse.split_events(events):
            sse.classify(event)


def test_an_event_that_never_ends_is_bounded() -> None:
    framer = sse.SSEFramer()
    chunk = b"data: " + b"x" * 65536
    try:
        for _ in range(sse.MAX_EVENT_BYTES // len(chunk) + 2):
            framer.feed(chunk)
    except sse.EventTooLarge:
        assert framer.pending <= sse.MAX_EVENT_BYTES + len(chunk)
        return
    raise AssertionError("an event without end was buffered without bound")


def _encodable(obj: Any) -> bool:
    try:
        orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return True


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10**6), st.sampled_from([b"", b" ", b"  "]))
def test_a_completion_token_count_of_any_length_is_a_number_or_unknown(digits: int, space: bytes) -> None:
    data = b'{"usage": {"completion_tokens":' + space + b"7" * digits + b"}}"
    tokens = completion_tokens(data)
    assert tokens is None or 0 <= tokens < 10**16
