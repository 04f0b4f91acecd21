"""Shared by the fake engine's tests: prefill bodies, SSE read-outs, a bounded wait."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, build_engine_app
from tests.wire import PREFILL_KV

ROOT = Path(__file__).resolve().parents[3]

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def prefill_body(n_words: int = 40, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "fake-model",
        "prompt": words(n_words),
        "stream": False,
        "max_tokens": 1,
        "ignore_eos": True,
        "kv_transfer_params": dict(PREFILL_KV),
    }
    body.update(extra)
    return body


def events(raw: bytes) -> list[str]:
    """SSE data payloads, in order (the fake never splits an event)."""
    assert raw.endswith(b"\n\n") or raw == b""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            out.append(block[len("data: ") :])
    return out


def decoded(raw: bytes) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e) for e in events(raw)]


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def two_engines(
    aiohttp_client: ClientFactory, consumer_local_kv: bool = True, **kwargs: Any
) -> tuple[FakeEngine, FakeEngine, TestClient[Any, Any], TestClient[Any, Any]]:
    producer = FakeEngine("p", **kwargs)
    consumer = FakeEngine("d", local_kv=consumer_local_kv)
    pc = await aiohttp_client(build_engine_app(producer))
    dc = await aiohttp_client(build_engine_app(consumer))
    return producer, consumer, pc, dc


def faulty(spec: dict[str, Any], phase: str = "decode", **body: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "fake-model", "prompt": "a b", "max_tokens": 4, "stream": True}
    base.update(body)
    base["narwhal_fake"] = {phase: spec}
    return base
