"""docs/behaviour.md "Placement" "What the prefill cached" for every P/D endpoint, through real gunicorn: the
producer's cached tokens, each endpoint in its own usage field (responses
``input_tokens_details.cached_tokens``, messages ``cache_read_input_tokens``), reach the access
log's ``prompt_tokens`` / ``cached_tokens`` and ``narwhal_prefill_tokens_total``.

One producer and one consumer with the fake's prefix cache, so both prefills of a test meet on
the producer that cached the first; the expected token counts are the fake's own model (a token
is 4 characters of the prompt text as the engine sees it, blocks of 16 tokens).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.fake_engine.prefix import PrefixCache, prompt_text, text_tokens
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import MODEL, access_line, scrape, send, settled, start_router, value

ENGINES = [{"name": "cp0", "role": "producer"}, {"name": "cd0", "role": "consumer"}]


@pytest.fixture(scope="module")
def cache_fleet() -> Iterator[FakeFleet]:
    started = FakeFleet.start(["cp0", "cd0"], args=["--model", MODEL, "--prefix-cache"])
    yield started
    started.stop()


@pytest.fixture(scope="module")
def router(cache_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = start_router(cache_fleet, ENGINES, tmp_path_factory.mktemp("cached"), server={"workers": 2})
    yield proc
    proc.stop()


def _bodies(path: str, shared: str) -> list[dict[str, Any]]:
    if path == "/v1/messages":
        return [{"model": MODEL, "max_tokens": 2, "stream": False, "system": shared,
                 "messages": [{"role": "user", "content": q}]} for q in ("first question", "other question")]
    return [{"model": MODEL, "max_output_tokens": 2, "stream": False, "instructions": shared, "input": q}
            for q in ("first question", "other question")]


def _expected(path: str, bodies: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, cached tokens of the second prefill) as the fake computes them."""
    kind = path.rsplit("/", 1)[1]
    texts = [prompt_text(body, chat=False, kind=kind) for body in bodies]
    cache = PrefixCache(capacity=10000)
    first, second = (cache.block_hashes(t) for t in texts)
    common = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), len(first))
    tokens = text_tokens(texts[1])
    return tokens, min(common, (tokens - 1) // 16) * 16


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_cached_tokens_of_each_endpoint_reach_the_access_log_and_the_counter(
    router: RouterProcess, path: str
) -> None:
    tag = uuid.uuid4().hex
    shared = tag + " " + "".join(f"block {i:02d} ".ljust(64, "x") for i in range(12))
    bodies = _bodies(path, shared)
    prompt_tokens, cached_tokens = _expected(path, bodies)
    assert cached_tokens >= 12 * 16
    before = scrape(router)
    lines = []
    for i, body in enumerate(bodies):
        rid = f"usage-{i}-{tag}"
        reply = await send(router.url, path, body, headers={"x-request-id": rid})
        assert reply.status == 200, reply.raw
        lines.append(access_line(router, rid))
    first, second = lines
    assert (first["prompt_tokens"], first["cached_tokens"]) == (
        text_tokens(prompt_text(bodies[0], chat=False, kind=path.rsplit("/", 1)[1])),
        # responses' usage says 0; messages leave the key out, and 0.33's descriptor says 0 (docs/decisions.md "vLLM
        # releases")
        0,
    )
    assert (second["prompt_tokens"], second["cached_tokens"]) == (prompt_tokens, cached_tokens)
    expected = {"cached": float(cached_tokens),
                "computed": float(first["prompt_tokens"] + prompt_tokens - cached_tokens)}

    def deltas() -> dict[str, float]:
        now = scrape(router)
        return {kind: value(now, "narwhal_prefill_tokens_total", kind=kind)
                - value(before, "narwhal_prefill_tokens_total", kind=kind) for kind in expected}

    assert settled(deltas, expected) == expected
