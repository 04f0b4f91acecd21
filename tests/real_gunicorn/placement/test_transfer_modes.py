"""docs/decisions.md "vLLM releases" through real gunicorn: a pull producer is never paired with a push consumer (NIXL's
compatibility hash holds the transfer mode), even when the push consumer is the idle one; with no
compatible consumer left the client gets 503 ``no_engine`` whose detail says why.

Two fleets: ``tp0`` and ``td0`` pull (the default), ``td1`` a push engine (``--transfer-mode
push``, and ``transfer_mode = "push"`` in the router's settings). ``td0`` serves background load
(another replica's requests, which its ``/metrics`` shows), so least-loaded placement alone would
put every decode on the idle ``td1``: only the mode rule keeps them on ``td0``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    admin,
    completion,
    error_of,
    records,
    send,
    start_router,
    unique_prompt,
    wait_state,
    wait_until,
)

ARGS = ["--model", MODEL, "--block-size", "4", "--lease-s", "60"]


@pytest.fixture(scope="module")
def modes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeFleet, FakeFleet, RouterProcess]]:
    pull = FakeFleet.start(["tp0", "td0"], args=ARGS)
    push = FakeFleet.start(["td1"], args=[*ARGS, "--transfer-mode", "push"])
    try:
        pull.set_background("td0", 4, hold_s=60)
        engines = [{"name": "tp0", "role": "producer"}, {"name": "td0", "role": "consumer"},
                   {"name": "td1", "role": "consumer", "transfer_mode": "push", "url": push.engines["td1"]}]
        router = start_router(pull, engines, tmp_path_factory.mktemp("modes"),
                              server={"workers": 2, "admin_token": TOKEN}, placement={"load_interval_s": 0.1})
        try:
            yield pull, push, router
        finally:
            router.stop()
    finally:
        push.stop()
        pull.stop()


async def test_a_pull_producer_is_never_paired_with_a_push_consumer(
    modes: tuple[FakeFleet, FakeFleet, RouterProcess]
) -> None:
    pull, push, router = modes
    listed = {e["name"]: e["transfer_mode"] for e in (await admin(router))["engines"]}
    assert listed == {"tp0": "pull", "td0": "pull", "td1": "push"}
    for _ in range(20):
        prompt = unique_prompt()
        reply = await send(router.url, "/v1/completions", completion(prompt, max_tokens=2))
        assert reply.status == 200, reply.raw
        assert len(records(pull, "td0", prompt)) == 1
    assert push.stats("td1")["requests"]["total"] == 0
    assert pull.stats("td0")["incompatible_decodes"] == push.stats("td1")["incompatible_decodes"] == 0

    await admin(router, "POST", "/admin/engines/td0/eject")
    await wait_state(router, "td0", "ejected")
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=2))
    assert reply.status == 503 and reply.headers["x-narwhal-error"] == "no_engine"
    assert "no consumer compatible with a producer" in error_of(reply)["message"]
    assert "transfer modes pull and push" in error_of(reply)["message"]
    assert push.stats("td1")["requests"]["total"] == 0
    await admin(router, "POST", "/admin/engines/td0/readmit")


@pytest.fixture(scope="module")
def connectors(modes: tuple[FakeFleet, FakeFleet, RouterProcess],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeFleet, RouterProcess]]:
    """``tp0`` on NixlConnector, ``td0`` configured on MooncakeConnector: no permitted pair at all."""
    pull = modes[0]
    engines = [{"name": "tp0", "role": "producer"},
               {"name": "td0", "role": "consumer", "kv_connector": "MooncakeConnector"}]
    router = start_router(pull, engines, tmp_path_factory.mktemp("connectors"), wait_ready=False,
                          server={"workers": 2, "admin_token": TOKEN})  # never ready: no pair
    try:
        wait_until(lambda: MODEL in http_get(router.url + "/v1/models")[1].decode(), 10, "the models read")
        yield pull, router
    finally:
        router.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
async def test_a_model_with_no_permitted_pair_answers_503_not_a_consumer_alone(
    connectors: tuple[FakeFleet, RouterProcess], path: str
) -> None:
    """Consumers sized for decode would take every prefill: never a silent local decode."""
    pull, router = connectors
    prompt = unique_prompt()
    body = completion(prompt, max_tokens=2) if path == "/v1/completions" else \
        {"model": MODEL, "input": prompt, "max_output_tokens": 2, "stream": True}
    reply = await send(router.url, path, body)
    assert reply.status == 503 and reply.headers["x-narwhal-error"] == "no_engine", reply.raw
    assert records(pull, "td0", prompt) == records(pull, "tp0", prompt) == []
