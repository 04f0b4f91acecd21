"""The fake's KV-cache events (``fake_engine.kv_events``) as vLLM's publisher sends them: frames,
the payload per release, vLLM's hash chain, ``/kv_event_sources``, replay, and the faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from narwhal.fake_engine import FakeEngine
from narwhal.fake_engine.kv_events import END_SEQ, Cleared, chain, event_hash, none_hash

PROMPT = "x" * 64 * 3 + "tail"  # three full blocks of 16 four-character tokens, then a partial one


@pytest.fixture
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[FakeEngine]:
    version = getattr(request, "param", "0.33.0")
    fake = FakeEngine("kv0", version=version, kv_events=True, enable_scale_out=True)
    fake.set_load_model(fake.load_model.model_copy(update={"prefix_cache": True}))
    await fake.start()
    yield fake
    await fake.close()


async def _subscribe(engine: FakeEngine) -> zmq.asyncio.Socket:
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    assert engine.kv_publisher is not None
    sub.connect(f"tcp://127.0.0.1:{engine.kv_publisher.port}")
    # A SUB's connect completes in the background (ZMQ's slow joiner): publish a probe batch until
    # one arrives, then start the publisher's sequence again so the test's batches are seq 0 on.
    publisher = engine.kv_publisher
    for _ in range(100):
        publisher.publish([Cleared()])
        if await sub.poll(50):
            break
    else:
        raise AssertionError("the subscription never heard its publisher")
    publisher.restarted(publisher.version)
    while await sub.poll(50):  # probes still on their way
        await sub.recv_multipart()
    return sub


async def _complete(engine: FakeEngine, prompt: str = PROMPT) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{engine.url}/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 2}) as resp:
        assert resp.status == 200


async def _recv(sub: zmq.asyncio.Socket) -> list[bytes]:
    return await asyncio.wait_for(sub.recv_multipart(), 5)


async def test_a_prefill_publishes_its_blocks_as_vllm_does(engine: FakeEngine) -> None:
    sub = await _subscribe(engine)
    await _complete(engine)
    topic, seq, payload = await _recv(sub)
    sub.close()
    assert topic == f"kv@127.0.0.1:{engine.port}@fake-model".encode() and seq == (0).to_bytes(8, "big")
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    async with aiohttp.ClientSession() as session, session.post(
            f"{engine.url}/tokenize", json={"model": "fake-model", "prompt": PROMPT}) as resp:
        tokens = (await resp.json())["tokens"]
    expected = [event_hash(d) for d, _ in chain(tokens, 16, none_hash((0, 33)))]
    assert events == [{"type": "BlockStored", "block_hashes": expected, "parent_block_hash": None,
                       "token_ids": tokens[:48], "block_size": 16, "lora_id": None, "medium": "GPU",
                       "lora_name": None, "extra_keys": [None, None, None], "group_idx": 0,
                       "kv_cache_spec_kind": "full_attention"}]


async def test_kv_event_sources_lists_the_publisher_and_replay_serves_what_it_kept(engine: FakeEngine) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{engine.url}/kv_event_sources") as resp:
        sources = await resp.json()
    assert engine.kv_publisher is not None
    assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": f"tcp://127.0.0.1:{engine.kv_publisher.port}",
                             "replay_endpoint": f"tcp://127.0.0.1:{engine.kv_publisher.replay_port}",
                             "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                             "topic": f"kv@127.0.0.1:{engine.port}@fake-model"}}
    engine.kv_publisher.fault = "gap"  # kept, not sent
    await _complete(engine)
    await _complete(engine, "y" * 64 + "z")
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sources["0"]["replay_endpoint"])
    await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replies = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
    dealer.close()
    assert [r[2] for r in replies] == [(0).to_bytes(8, "big"), (1).to_bytes(8, "big"), END_SEQ]
    assert replies[-1] == [b"", b"", END_SEQ, b""] and replies[0][1] == sources["0"]["topic"].encode()
    assert engine.kv_publisher.sent == 1  # seq 0 only replayed: the gap


@pytest.mark.parametrize("engine", ["0.21.0"], indirect=True)
async def test_releases_before_0_24_send_positional_events_and_no_sources_route(engine: FakeEngine) -> None:
    sub = await _subscribe(engine)
    await _complete(engine)
    _, _, payload = await _recv(sub)
    sub.close()
    event: list[Any] = msgspec.msgpack.decode(payload)[1][0]
    assert event[0] == "BlockStored" and len(event) == 10 and event[4] == 16 and event[6] == "GPU"
    async with aiohttp.ClientSession() as session, session.get(f"{engine.url}/kv_event_sources") as resp:
        assert resp.status == 404


async def test_a_restarted_engine_starts_its_sequence_again(engine: FakeEngine) -> None:
    sub = await _subscribe(engine)
    await _complete(engine)
    assert (await _recv(sub))[1] == (0).to_bytes(8, "big")
    engine.restarted()
    await asyncio.sleep(0.3)  # the SUB reconnects to the new publisher on its own
    await _complete(engine)
    assert (await _recv(sub))[1] == (0).to_bytes(8, "big")
    sub.close()
