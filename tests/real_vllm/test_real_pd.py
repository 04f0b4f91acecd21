"""Narwhal under real gunicorn in front of a real vLLM pair (vLLM's CPU build, NIXL on CPU).

What the real tier shows (docs/testing.md, "The real tier"): preflight passes on the pair,
``/ready`` is 200, streamed completions and chat go through P/D with the consumer really
loading the producer's KV (its own ``/metrics`` say so), ``/admin/engines`` shows the version
and the capacity and load read from real ``/metrics``, and the openai SDK streams through it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import openai
import orjson
import pytest

from narwhal.engines.dialects.openai import Chat
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import RouterProcess
from tests.real_gunicorn.support import access_line, admin, engine_entry, scrape, send, value, wait_until
from tests.real_vllm.conftest import VERSION, needs_transfer, router_config
from tests.real_vllm.engines import MODEL, RealEngine, get, metric

pytestmark = pytest.mark.timeout(300)


def prompt(words: int = 60) -> str:
    """A prompt of its own (so no prefix cache hides a transfer), about ``words`` tokens long."""
    return uuid.uuid4().hex + " " + " ".join(f"the router sends block {i}" for i in range(words // 5))


def kv_reads(consumer: RealEngine) -> float:
    """How many NIXL reads the consumer made (one per handoff it loaded)."""
    return metric(consumer.metrics(), "vllm:nixl_xfer_time_seconds_count")


def external_tokens(consumer: RealEngine) -> float:
    return metric(consumer.metrics(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_preflight_passes_on_the_real_pair(real_pair: list[RealEngine]) -> None:
    done = subprocess.run([sys.executable, "-m", "narwhal.cli", "preflight", "--config", router_config(real_pair)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


async def test_ready_and_the_admin_view_read_the_real_engines(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    reply = await send(real_router.url, "/ready", method="GET")
    assert reply.status == 200, reply.raw
    engines = {e["name"]: e for e in (await admin(real_router))["engines"]}
    producer, consumer = real_pair
    for engine in real_pair:
        entry = engines[engine.name]
        assert entry["version"] == VERSION, entry
        assert entry["models"] == [MODEL] and entry["state"] == "admitted", entry
        assert entry["load"] is not None and entry["load"]["age_s"] < 5, entry  # read from its /metrics
    holdings = engines[producer.name]["holdings"]
    # Capacity from vllm:cache_config_info: num_gpu_blocks x block_size of the real engine.
    cache = producer.metrics()
    blocks = [line for line in cache.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert blocks, "no vllm:cache_config_info"
    assert holdings["capacity_blocks"] and holdings["capacity_blocks"] > 0, holdings
    # The router's /v1/models passes on the engines' card: their context length and model root.
    listing = (await send(real_router.url, "/v1/models", method="GET")).json
    real = orjson.loads(get(producer.url + "/v1/models", 10)[1])["data"][0]
    card = listing["data"][0]
    assert (card["id"], card["max_model_len"], card["root"]) == (MODEL, real["max_model_len"], real["root"]), card


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_goes_through_pd_and_the_consumer_loads_the_kv(
    real_router: RouterProcess, real_pair: list[RealEngine], path: str, nixl_moves: str | None
) -> None:
    needs_transfer(nixl_moves)
    producer, consumer = real_pair
    reads, tokens = kv_reads(consumer), external_tokens(consumer)
    text = prompt()
    body: dict[str, object] = {"model": MODEL, "max_tokens": 8, "stream": True, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    reply = await send(real_router.url, path, body)
    assert reply.status == 200, reply.raw
    events = reply.events
    assert events[-1] == b"[DONE]", events[-3:]
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert kv_reads(consumer) == reads + 1  # exactly one NIXL read: this request's handoff
    assert external_tokens(consumer) > tokens  # its prompt came from the producer's KV


async def test_the_openai_sdk_streams_through_it(
    real_router: RouterProcess, real_pair: list[RealEngine], nixl_moves: str | None
) -> None:
    needs_transfer(nixl_moves)
    consumer = real_pair[1]
    reads = kv_reads(consumer)
    client = openai.AsyncOpenAI(base_url=real_router.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt()}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 6, usage
    assert "".join(pieces)
    assert kv_reads(consumer) == reads + 1


async def test_the_routers_holdings_follow_the_real_producers_kv_events(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    """The producer publishes its KV-cache events (``--kv-events-config``, over a local socket);
    the router's supervisor follows them from its ``/kv_event_sources``: ``/admin/engines`` says
    ``events``, and the block set it keeps is the one the engine published, counted by a
    subscriber of this test's own."""
    import msgspec
    import zmq
    import zmq.asyncio

    producer = real_pair[0]
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(str(producer.kv_events_config()["endpoint"]))
    held: set[object] = set()
    try:
        for _ in range(30):  # until both subscribers hear (a SUB connects in the background)
            reply = await send(real_router.url, "/v1/completions",
                               {"model": MODEL, "prompt": prompt(300), "max_tokens": 2})
            assert reply.status == 200, reply.raw
            while await sub.poll(500):
                _, _, payload = await sub.recv_multipart()
                for event in msgspec.msgpack.decode(payload)[1]:
                    kind = event["type"] if isinstance(event, dict) else event[0]
                    hashes = event["block_hashes"] if isinstance(event, dict) else event[1]
                    if kind == "BlockStored":
                        held.update(hashes)
                    elif kind == "BlockRemoved":
                        held.difference_update(hashes)
            entry = next(e for e in (await admin(real_router))["engines"] if e["name"] == producer.name)
            if held and (entry["holdings"] or {}).get("source") == "events":
                break
        assert held and (entry["holdings"] or {}).get("source") == "events", entry
        wait_until(lambda: value(scrape(real_router), "narwhal_kv_event_blocks", engine=producer.name) >= len(held),
                   30, "the router's block set caught up")
    finally:
        sub.close()


async def test_placement_predicts_the_cached_tokens_the_real_producer_reports(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    """A chat prompt asked again once the producer's events for it are in: the router took its
    token ids from the producer's ``/tokenize`` (the chat template applied there), matched them
    with the blocks the producer published, and predicted exactly the cached tokens the producer
    then reports."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": prompt(300)},
                                         {"role": "user", "content": "which block comes last?"}], "max_tokens": 2}
    line: dict[str, object] = {}
    for attempt in range(20):  # the first prefills it; once its events are in, the next is predicted
        rid = f"predicted-{uuid.uuid4().hex}"
        reply = await send(real_router.url, "/v1/chat/completions", body, headers={"x-request-id": rid})
        assert reply.status == 200, reply.raw
        line = access_line(real_router, rid)
        if attempt and line["predicted_cached_tokens"]:
            break
    assert line["producer"] == real_pair[0].name
    assert line["predicted_cached_tokens"] == line["cached_tokens"], line
    assert isinstance(line["cached_tokens"], int) and line["cached_tokens"] > 0, line


def _conversation_router(pair: list[RealEngine], tmp: pytest.TempPathFactory, **placement: object) -> RouterProcess:
    """A router of its own over the pair, one worker, its access log beside its log."""
    logs = tmp.mktemp("conversation")
    return RouterProcess.start(router_config(pair, placement=placement, log={"access_log": str(logs / "access.log")}),
                               workers=1, timeout=60, log_path=str(logs / "router.log"))


async def _first_turn(router: RouterProcess, max_tokens: int) -> tuple[list[dict[str, object]], str]:
    """A conversation's first chat turn through ``router``: its messages, and the answer (``max_tokens``
    of it, ``ignore_eos``)."""
    first: list[dict[str, object]] = [{"role": "system", "content": prompt(300)},
                                      {"role": "user", "content": "name the last block"}]
    reply = await send(router.url, "/v1/chat/completions",
                       {"model": MODEL, "messages": first, "max_tokens": max_tokens, "ignore_eos": True})
    assert reply.status == 200, reply.raw
    return first, reply.json["choices"][0]["message"]["content"]


async def test_a_follow_up_turn_the_consumer_holds_is_decoded_there_alone(
    real_pair: list[RealEngine], nixl_moves: str | None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """docs/behaviour.md "Placement": the consumer's own KV-cache events say it holds the first
    turn (its prompt, loaded over NIXL, and the answer it decoded); the follow-up turn, whose
    prompt starts with both, is decoded on the consumer alone (``placement.skip_prefill_share``,
    lowered here for a short conversation), and the consumer reports the cached tokens."""
    needs_transfer(nixl_moves)
    producer, consumer = real_pair
    router = _conversation_router(real_pair, tmp_path_factory, skip_prefill_share=0.5)
    try:
        first, answer = await _first_turn(router, 40)
        follow_up = {"model": MODEL, "max_tokens": 2, "messages": [
            *first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and the first?"}]}
        line: dict[str, object] = {}
        usage: dict[str, object] = {}
        for _ in range(20):  # until the consumer's events for the first turn are in
            rid = f"follow-up-{uuid.uuid4().hex}"
            reply = await send(router.url, "/v1/chat/completions", follow_up, headers={"x-request-id": rid})
            assert reply.status == 200, reply.raw
            line, usage = access_line(router, rid), reply.json["usage"]
            if line["mode"] == "local":
                break
        assert (line["mode"], line["producer"], line["consumer"]) == ("local", None, consumer.name), line
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")  # type: ignore[union-attr]
        assert isinstance(cached, int) and cached > 0, usage
    finally:
        router.stop()


async def test_without_events_a_follow_up_goes_to_the_consumer_that_wrote_its_answer(
    real_pair: list[RealEngine], nixl_moves: str | None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """docs/behaviour.md "Placement", without KV-cache events (``placement.kv_events = false``):
    the consumer learned the first turn's prompt from decoding it, and holds the answer it wrote
    right after it; the follow-up, whose prompt alone it would not hold to the share, is decoded
    there alone, and the real consumer serves it from its cache."""
    needs_transfer(nixl_moves)
    _, consumer = real_pair
    router = _conversation_router(real_pair, tmp_path_factory, kv_events=False, skip_prefill_share=0.9)
    try:
        first, answer = await _first_turn(router, 200)
        messages = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and the first?"}]

        def blocks(turns: list[dict[str, object]]) -> int:
            return PrefixBlocks(Chat().affinity_text({"messages": turns}, 65537) or "", 256, 65536).count

        assert blocks(first) / blocks(messages) < 0.9, len(answer)  # its prompt alone: P/D
        for _ in range(40):  # until the supervisor has published what the consumer learned
            held = (await engine_entry(router, consumer.name))["holdings"]
            if held and held["blocks"] >= blocks(first):
                break
            await asyncio.sleep(0.25)
        # The first follow-up: one decoded P/D would teach the consumer its whole prompt.
        rid = f"follow-up-{uuid.uuid4().hex}"
        reply = await send(router.url, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                 "max_tokens": 2}, headers={"x-request-id": rid})
        assert reply.status == 200, reply.raw
        line, usage = access_line(router, rid), reply.json["usage"]
        assert (line["mode"], line["producer"], line["consumer"]) == ("local", None, consumer.name), (line, held)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")  # type: ignore[union-attr]
        assert isinstance(cached, int) and cached > 0, usage
    finally:
        router.stop()


async def test_the_fakes_kv_event_frames_have_the_real_publishers_shape(
    real_router: RouterProcess, real_pair: list[RealEngine]
) -> None:
    """The fake engine's KV-event batches (``narwhal/fake_engine/kv_events.py``, for this release)
    against what the real producer publishes for a prompt: the same frames, the same batch
    layout, and each event kind with the same keys, each value of the same type."""
    import msgspec
    import zmq
    import zmq.asyncio

    from narwhal.fake_engine.kv_events import Removed, Stored, encode_batch, encode_event

    producer = real_pair[0]
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(str(producer.kv_events_config()["endpoint"]))
    real: dict[str, object] = {}
    frames: list[bytes] = []
    batch: list[object] = []
    try:
        for _ in range(30):  # until the subscriber hears a store (a SUB connects in the background)
            reply = await send(real_router.url, "/v1/completions",
                               {"model": MODEL, "prompt": prompt(300), "max_tokens": 2})
            assert reply.status == 200, reply.raw
            while await sub.poll(500):
                frames = await sub.recv_multipart()
                batch = msgspec.msgpack.decode(frames[2])
                for event in batch[1]:
                    real.setdefault(event["type"], event)
            if "BlockStored" in real:
                break
    finally:
        sub.close()
    assert "BlockStored" in real, real
    assert len(frames) == 3 and len(frames[1]) == 8 and frames[0] == b"kv"

    def shape(value: object) -> object:
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items()}
        if isinstance(value, list):
            return ["list", shape(value[0]) if value else None]
        return type(value).__name__

    release = tuple(int(p) for p in VERSION.split(".")[:2])
    stored = real["BlockStored"]
    assert isinstance(stored, dict)
    fake = encode_event(Stored(list(stored["block_hashes"]), stored["parent_block_hash"], list(stored["token_ids"])),
                        int(stored["block_size"]), release)
    assert shape(fake) == shape(stored), (fake, stored)
    if "BlockRemoved" in real:
        removed = real["BlockRemoved"]
        assert isinstance(removed, dict)
        assert shape(encode_event(Removed(removed["block_hashes"][0]), 16, release)) == shape(removed)
    fake_batch = msgspec.msgpack.decode(encode_batch([fake], 1.0))
    assert [shape(v) for i, v in enumerate(fake_batch) if i != 1] == [shape(v) for i, v in enumerate(batch) if i != 1]
