"""What a real engine sends, beside what the fake sends for the same release (vLLM 0.32.0).

The fake is the engine's stand-in in every other test, so every shape the router reads must be
the real one: the handoff descriptor (its keys in order, their types, the block list's nesting
and count), ``/version``, ``/v1/models``, the error bodies of a refused request, the stream
chunks' keys, and the metric series placement reads. A difference is a fake bug, or one of the
differences docs/decisions.md lists ("The fake beside a real engine"), which no test here reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from narwhal.testing.harness import FakeFleet
from tests.real_vllm.conftest import VERSION
from tests.real_vllm.engines import CONTEXT, MODEL, RealEngine, get, post

pytestmark = pytest.mark.timeout(300)
BLOCK = 128  # the CPU build's default KV block size, as the real engine reports it


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    fleet = FakeFleet.start(["f0"], args=["--vllm-version", VERSION, "--model", MODEL, "--block-size", str(BLOCK),
                                          "--max-model-len", str(CONTEXT)])
    yield fleet.engines["f0"]
    fleet.stop()


def _both(real_pair: list[RealEngine], fake_url: str) -> list[str]:
    return [real_pair[0].url, fake_url]


def _types(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return type(value).__name__


def _descriptor(url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "the router sends every prompt to a producer engine", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    status, raw = post(url + "/v1/completions", body, 60)
    assert status == 200, raw
    return dict(orjson.loads(raw)["kv_transfer_params"])


def test_the_descriptor_has_the_real_keys_types_and_blocks(real_pair: list[RealEngine], fake_url: str) -> None:
    real, fake = (_descriptor(u) for u in _both(real_pair, fake_url))
    assert list(fake) == list(real)  # the keys, in the engine's order
    for key in ("remote_engine_id", "remote_request_id", "remote_port", "remote_num_tokens", "remote_block_ids"):
        real.pop(key), fake.pop(key)  # values of their own; their types are compared below
    assert fake == real
    for desc in (_descriptor(real_pair[0].url), _descriptor(fake_url)):
        blocks = desc["remote_block_ids"]
        assert type(blocks) is list and len(blocks) == 1 and all(type(b) is int for b in blocks[0])
        assert len(blocks[0]) == -(-desc["remote_num_tokens"] // BLOCK)  # cdiv: the partial block too
        assert _types({k: desc[k] for k in ("remote_engine_id", "remote_request_id", "remote_port")}) == {
            "remote_engine_id": "str", "remote_request_id": "str", "remote_port": "int"}


def test_version_and_models_have_the_real_shape(real_pair: list[RealEngine], fake_url: str) -> None:
    versions = [orjson.loads(get(u + "/version", 10)[1]) for u in _both(real_pair, fake_url)]
    assert versions[0] == versions[1] == {"version": VERSION}
    real, fake = (orjson.loads(get(u + "/v1/models", 10)[1]) for u in _both(real_pair, fake_url))
    assert _types(fake) == _types(real)
    assert fake["data"][0]["max_model_len"] == real["data"][0]["max_model_len"] == CONTEXT


@pytest.mark.parametrize(("why", "body"), [
    ("unknown model", {"model": "nope", "prompt": "x", "max_tokens": 2}),
    ("stream options without a stream", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}),
    ("a mistyped stop", {"model": MODEL, "prompt": "x", "stop": 5}),
    ("max_tokens beyond the context", {"model": MODEL, "prompt": "x", "max_tokens": 5000}),
    ("a non-numeric max_tokens", {"model": MODEL, "prompt": "x", "max_tokens": "two"}),
])
def test_a_refusal_has_the_real_status_type_and_param(
    real_pair: list[RealEngine], fake_url: str, why: str, body: dict[str, Any]
) -> None:
    (real_status, real_raw), (fake_status, fake_raw) = (post(u + "/v1/completions", body, 60)
                                                       for u in _both(real_pair, fake_url))
    real, fake = orjson.loads(real_raw)["error"], orjson.loads(fake_raw)["error"]
    assert fake_status == real_status, why
    assert (fake["type"], fake["param"], fake["code"]) == (real["type"], real["param"], real["code"]), why
    first = real["message"].split(":")[0].split(" Valid aliases")[0]
    assert fake["message"].startswith(first), (why, real["message"], fake["message"])


def _chunks(url: str, path: str) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": True, "ignore_eos": True}
    body.update({"prompt": "hello there"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hello there"}]})
    status, raw = post(url + path, body, 60)
    assert status == 200, raw
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def _keys(chunk: dict[str, Any]) -> tuple[frozenset[str], frozenset[str]]:
    """A chunk's top-level keys and its first choice's, less what docs/decisions.md lists."""
    top = frozenset(chunk) - {"system_fingerprint"}
    choice = frozenset(chunk["choices"][0]) if chunk.get("choices") else frozenset()
    return top, choice


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_chunks_have_the_real_keys(real_pair: list[RealEngine], fake_url: str, path: str) -> None:
    real, fake = (_chunks(u, path) for u in _both(real_pair, fake_url))
    assert {_keys(c) for c in fake} <= {_keys(c) for c in real}, (real, fake)
    assert fake[-1]["choices"][0]["finish_reason"] == real[-1]["choices"][0]["finish_reason"] == "length"


def test_the_series_placement_reads_are_there(real_pair: list[RealEngine], fake_url: str) -> None:
    for url in _both(real_pair, fake_url):
        text = get(url + "/metrics", 10)[1].decode()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert f"\n{name}{{" in text, (url, name)
        info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
        for label in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "engine"):
            assert f',{label}="' in info or f'{{{label}="' in info, (url, label)
        assert f'block_size="{BLOCK}"' in info, url
