"""docs/behaviour.md "The request path" routes, admission ("Admission"), metrics and the access log,
through real gunicorn.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import RouterProcess, write_config
from tests.real_gunicorn.support import (
    MODEL,
    access_line,
    at_rest,
    chat,
    completion,
    error_of,
    send,
    settled,
    unique_prompt,
)


@pytest.mark.parametrize(
    ("path", "raw", "fragment"),
    [
        ("/v1/completions", b"{not json", "invalid JSON body"),
        ("/v1/completions", b"\xff\xfe{}", "invalid JSON body"),
        ("/v1/completions", b"[1, 2]", "must be a JSON object"),
        ("/v1/completions", b'{"model": "fake-model"}', "'prompt' is required"),
        ("/v1/chat/completions", b'{"model": "fake-model", "messages": "hi"}', "'messages' must be a list"),
        ("/v1/completions", b'{"model": 5, "prompt": "x"}', "'model' must be a string"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "stream": "yes"}', "'stream' must be"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": -1}', "'max_tokens'"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": {"a": 1}}', "'prompt' must be"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "stream_options": []}', "'stream_options'"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "n": 2}', "'n' > 1"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "best_of": 3}', "'best_of' > 1"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "prompt_logprobs": 2}', "'prompt_logprobs'"),
    ],
)
async def test_bad_requests_are_400_in_the_openai_shape(router: RouterProcess, path: str, raw: bytes,
                                                        fragment: str) -> None:
    reply = await send(router.url, path, raw=raw)
    assert reply.status == 400
    assert reply.headers["x-narwhal-error"] == "bad_request"
    err = error_of(reply)
    assert err["type"] == "bad_request" and err["code"] == 400
    # The field at fault is named where admission checks it as vLLM does (the prefill drops it).
    assert err["param"] == ("stream_options" if fragment == "'stream_options'" else None)
    assert fragment in err["message"]
    assert "Traceback" not in err["message"]


async def test_unknown_model_is_404(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert reply.status == 404
    assert reply.headers["x-narwhal-error"] == "model_not_found"
    assert error_of(reply) == {"message": "The model `nope` does not exist.", "type": "model_not_found",
                               "param": None, "code": 404}


async def test_wrong_content_type_is_415(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions", raw=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert reply.status == 415
    assert error_of(reply)["type"] == "unsupported_media_type"


async def test_oversized_body_is_413(router: RouterProcess) -> None:
    huge = b'{"model": "fake-model", "prompt": "' + b"a" * (8 * 1024 * 1024 + 10) + b'"}'
    reply = await send(router.url, "/v1/completions", raw=huge)
    assert reply.status == 413
    assert reply.headers["x-narwhal-error"] == "payload_too_large"


async def test_oversized_headers_are_431(router: RouterProcess) -> None:
    headers = {f"x-pad-{i}": "v" * 1000 for i in range(20)}
    reply = await send(router.url, "/v1/completions", completion("x"), headers=headers)
    assert reply.status == 431
    assert error_of(reply)["type"] == "header_too_large" and reply.headers["x-narwhal-error"] == "header_too_large"


async def test_unknown_route_and_admin_without_token_are_404_not_found(router: RouterProcess) -> None:
    for path in ("/v2/nothing", "/admin/engines"):
        reply = await send(router.url, path, method="GET")
        assert reply.status == 404
        assert reply.headers["x-narwhal-error"] == "not_found"
        assert error_of(reply)["type"] == "not_found"


async def test_request_id_is_echoed_or_created_on_every_response(router: RouterProcess) -> None:
    ok = await send(router.url, "/v1/completions", completion(unique_prompt()), headers={"x-request-id": "abc-123"})
    bad = await send(router.url, "/v1/completions", raw=b"{", headers={"x-request-id": "abc-456"})
    assert ok.headers["x-request-id"] == "abc-123"
    assert bad.headers["x-request-id"] == "abc-456"
    fresh = await send(router.url, "/health", method="GET")
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])


async def test_models_health_and_ready(router: RouterProcess) -> None:
    models = await send(router.url, "/v1/models", method="GET")
    assert models.status == 200
    assert models.json["object"] == "list"
    assert [m["id"] for m in models.json["data"]] == [MODEL]
    assert (await send(router.url, "/health", method="GET")).status == 200
    ready = await send(router.url, "/ready", method="GET")
    assert (ready.status, ready.json) == (200, {"ready": True})


@pytest.fixture(scope="module")
def unready_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("unready")
    config = write_config(
        [{"name": "p9", "url": "http://127.0.0.1:9", "role": "producer"},
         {"name": "d9", "url": "http://127.0.0.1:9", "role": "consumer"}],
        {"preflight": {"on_start": False}, "log": {"access_log": ""}},
    )
    proc = RouterProcess.start(config, wait_ready=False, log_path=str(tmp / "router.log"))
    yield proc
    proc.stop()


async def test_ready_is_503_with_a_reason_when_no_pair_exists(unready_router: RouterProcess) -> None:
    reply = await send(unready_router.url, "/ready", method="GET")
    assert reply.status == 503
    assert reply.json == {"ready": False, "reason": "no engine has reported a model yet"}


def _sample(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


async def test_metrics_count_every_request_across_workers(router: RouterProcess) -> None:
    before = at_rest(router, "narwhal_requests_total", "narwhal_ttft_seconds", "narwhal_first_byte_seconds",
                     "narwhal_handoff_age_seconds", "narwhal_attempts_total")
    n = 12
    for _ in range(n):  # one connection each: both workers take some
        assert (await send(router.url, "/v1/completions", completion(unique_prompt()))).status == 200
    assert (await send(router.url, "/v1/completions", raw=b"{")).status == 400
    expected = {
        ("narwhal_requests_total", f'code="200",endpoint="/v1/completions",model="{MODEL}"'): n,
        ("narwhal_requests_total", 'code="400",endpoint="/v1/completions",model=""'): 1,
        ("narwhal_ttft_seconds_count", ""): n,
        ("narwhal_first_byte_seconds_count", ""): n,
        ("narwhal_handoff_age_seconds_count", ""): n,
        ("narwhal_attempts_total", 'outcome="success"'): n,
    }

    def deltas() -> dict[tuple[str, str], float]:
        after = http_get(router.url + "/metrics")[1].decode()
        return {key: _sample(after, *key) - _sample(before, *key) for key in expected}

    # A worker counts a request just after its last bytes went out (off the client's latency),
    # so a scrape answered by the other worker in that instant may be a request short.
    assert settled(deltas, expected) == expected


async def test_latency_histograms_count_a_prefill_whose_decode_failed(router: RouterProcess) -> None:
    # Observed after the first output left (off the first token's path), yet still once per
    # finished prefill: a decode refused before any output counts ttft and handoff_age, not first_byte.
    before = at_rest(router, "narwhal_ttft_seconds", "narwhal_handoff_age_seconds", "narwhal_first_byte_seconds")
    refused = await send(router.url, "/v1/completions", completion(
        unique_prompt(), stream=False, fake={"decode": {"status": 400, "message": "no such adapter"}}))
    assert refused.status == 400
    ok = await send(router.url, "/v1/completions", completion(unique_prompt(), stream=False))
    assert ok.status == 200
    expected = {
        ("narwhal_ttft_seconds_count", ""): 2,
        ("narwhal_handoff_age_seconds_count", ""): 2,
        ("narwhal_first_byte_seconds_count", ""): 1,
    }

    def deltas() -> dict[tuple[str, str], float]:
        after = http_get(router.url + "/metrics")[1].decode()
        return {key: _sample(after, *key) - _sample(before, *key) for key in expected}

    assert settled(deltas, expected) == expected


async def test_access_log_has_one_json_line_per_request(router: RouterProcess) -> None:
    rid = "access-" + unique_prompt().split()[0]
    reply = await send(router.url, "/v1/chat/completions", chat(unique_prompt()), headers={"x-request-id": rid})
    assert reply.status == 200
    entry = access_line(router, rid)
    assert entry["model"] == MODEL and entry["endpoint"] == "/v1/chat/completions"
    assert entry["status"] == 200 and entry["attempts"] == 1 and entry["reason"] is None
    assert entry["producer"] in ("p0", "p1") and entry["consumer"] in ("d0", "d1")
    assert 0 < entry["ttft_s"] <= entry["first_byte_s"] <= entry["total_s"]
    assert "messages" not in entry and "prompt" not in entry
