"""Following an engine's KV-cache events (``supervisor.kv_events``): both payload shapes decoded
and nothing trusted, the sequence rules (gap, duplicate, restart, a replay that cannot fill), and
the hub against a fake engine's real publisher over ZMQ."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from narwhal.fake_engine import FakeEngine
from narwhal.supervisor.kv_events.decode import Cleared, Removed, Stored, Unreadable, decode_batch
from narwhal.supervisor.kv_events.hub import KvEventsHub, endpoints
from narwhal.supervisor.kv_events.stream import APPLIED, DUPLICATE, GAP, RESTART, Stream

ENC = msgspec.msgpack.Encoder()


def _payload(*events: Any) -> bytes:
    return ENC.encode([1.5, list(events), 0])


STORED_MAP = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
              "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
              "group_idx": 0, "kv_cache_spec_kind": "full_attention", "a_key_from_a_newer_release": 1}
STORED_ARRAY = ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None, [None, None], 0]


@pytest.mark.parametrize("stored", [STORED_MAP, STORED_ARRAY], ids=["0.24+ maps", "0.21 arrays"])
def test_both_shapes_decode_to_the_same_events(stored: Any) -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"} if isinstance(stored, dict) else \
        ["BlockRemoved", [12], "GPU", 0]
    cleared = {"type": "AllBlocksCleared"} if isinstance(stored, dict) else ["AllBlocksCleared"]
    ts, events = decode_batch(_payload(stored, removed, cleared, {"type": "SomethingNew"}))
    assert ts == 1.5 and events == [Stored((11, 12), None, (1, 2, 3, 4), 2), Removed((12,)), Cleared()]


@pytest.mark.parametrize("payload", [b"\xc1", ENC.encode({"a": 1}), ENC.encode([1.0, "x", 0]),
                                     _payload({**STORED_MAP, "block_hashes": [-1]}),
                                     _payload({**STORED_MAP, "token_ids": "abc"}),
                                     _payload({**STORED_MAP, "block_size": 0}), _payload(7)])
def test_a_payload_vllm_would_not_send_is_unreadable_never_another_error(payload: bytes) -> None:
    with pytest.raises(Unreadable):
        decode_batch(payload)


def _batch(seq: int, *hashes: int, parent: int | None = None) -> tuple[int, bytes, list[Any]]:
    payload = _payload({**STORED_MAP, "block_hashes": list(hashes), "parent_block_hash": parent,
                        "token_ids": [seq] * 2 * len(hashes)})
    return seq, payload, decode_batch(payload)[1]


def test_a_stream_applies_in_order_skips_a_duplicate_and_resets_on_a_restart() -> None:
    stream = Stream()
    assert stream.live(*_batch(0, 1, 2)) == APPLIED and stream.blocks == {1: None, 2: 1}
    assert stream.live(*_batch(0, 1, 2)) == DUPLICATE
    assert stream.live(*_batch(1, 3, parent=2)) == APPLIED and stream.next_seq == 2
    assert stream.live(*_batch(3, 5)) == GAP and stream.next_seq == 2  # nothing applied past a gap
    assert stream.live(*_batch(0, 9)) == RESTART and stream.blocks == {9: None} and stream.resets == 1


def test_a_replay_fills_a_gap_or_resets_when_it_cannot() -> None:
    stream = Stream()
    stream.live(*_batch(0, 1))
    assert stream.replayed(1, 3, [_batch(1, 2, parent=1), _batch(2, 3, parent=2)])
    assert stream.blocks == {1: None, 2: 1, 3: 2} and stream.next_seq == 3
    # The buffer rolled: vLLM replays silently from the oldest batch it kept (5, not 3).
    assert not stream.replayed(3, 6, [_batch(5, 8)])
    assert stream.blocks == {8: None} and stream.resets == 1 and stream.next_seq == 6
    assert not stream.replayed(6, 9, [])  # nothing kept at all
    assert stream.blocks == {} and not stream.in_sync


@pytest.mark.parametrize(("sources", "found"), [
    ({"0": {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
            "topic": "kv"}}, ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv")),
    ([{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": None, "topic": ""}],
     ("tcp://10.0.0.1:5557", None, "")),
    ({}, None), ({"0": {"enable_kv_cache_events": False, "endpoint": "tcp://*:1"}}, None),
    ({"0": {"endpoint": 5}}, None), ("garbage", None),
    ({"0": {"endpoint": "ipc:///run/kv.pub", "replay_endpoint": "ipc:///run/kv.replay"}},
     ("ipc:///run/kv.pub", "ipc:///run/kv.replay", "")),
])
def test_sources_are_read_from_either_shape_with_a_wildcard_as_the_engines_host(sources: Any, found: Any) -> None:
    assert endpoints(sources, "http://10.0.0.5:8100") == found


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine("kv1", kv_events=True)
    fake.set_load_model(fake.load_model.model_copy(update={"prefix_cache": True}))
    await fake.start()
    yield fake
    await fake.close()


async def _complete(engine: FakeEngine, prompt: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{engine.url}/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 2}) as resp:
        assert resp.status == 200


async def _until(check: Any, what: str, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for: {what}"
        await asyncio.sleep(0.02)


async def test_the_hub_follows_a_publisher_fills_a_gap_and_resets_on_a_restart(engine: FakeEngine) -> None:
    resets: list[tuple[str, str]] = []
    async with aiohttp.ClientSession() as session:
        hub = KvEventsHub(session, lambda name, why: resets.append((name, why)))
        hub.follow([("kv1", engine.url)])
        await _until(lambda: "kv1" in hub.streams, "the subscription")
        stream = hub.streams["kv1"]
        prompt = "a" * 64 * 2
        while not stream.in_sync:  # the SUB's connect completes in the background: publish until it hears
            await _complete(engine, prompt + str(stream.resets) + "b" * 70)
            await asyncio.sleep(0.05)
        assert hub.source("kv1") == "events"
        assert engine.kv_publisher is not None
        engine.kv_publisher.fault = "gap"  # kept for replay, not sent
        await _complete(engine, "c" * 64)
        await _complete(engine, "d" * 64)  # its seq shows the gap: replayed
        await _until(lambda: stream.next_seq == engine.kv_publisher._seq, "the gap replayed")  # type: ignore[union-attr]
        assert resets == [] and hub.source("kv1") == "events"
        cached = set(engine.cache._cached)  # type: ignore[union-attr]
        assert set(stream.blocks) == cached  # exactly what the engine holds
        engine.restarted()
        await _complete(engine, "e" * 64)
        await _until(lambda: resets, "the restart seen")
        assert resets == [("kv1", "its sequence started again (a restarted engine)")]
        engine.kv_publisher.fault = "gap_past_replay"
        await _complete(engine, "f" * 64)
        await _complete(engine, "g" * 64)
        await _until(lambda: len(resets) == 2, "the unfillable gap seen")
        assert resets[1] == ("kv1", "a gap its replay could not fill")
        hub.close()


async def test_an_engine_without_a_publisher_stays_on_learned_holdings_and_is_tried_again() -> None:
    """Events off (``{}``), or nothing listening at all: learned holdings, and the subscription's
    task goes on (it asks again after ``RETRY_S``), never an exception out of it."""
    plain = FakeEngine("kv2")  # a 0.33 engine without --kv-events: /kv_event_sources answers {}
    await plain.start()
    try:
        async with aiohttp.ClientSession() as session:
            hub = KvEventsHub(session, lambda name, why: None)
            hub.follow([("kv2", plain.url), ("gone", "http://127.0.0.1:9")])
            await asyncio.sleep(0.3)  # long enough for both first tries to end (each a refused or {} answer)
            assert hub.source("kv2") == hub.source("gone") == "learned"
            assert not any(task.done() for task in hub._tasks.values())
            hub.close()
    finally:
        await plain.close()
