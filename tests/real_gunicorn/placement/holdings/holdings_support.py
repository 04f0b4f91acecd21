"""What the ``test_holdings_*`` modules share (docs/behaviour.md "Placement" through real gunicorn): their fleet, their
router, their prefixes, and reading holdings and prediction counters.

Each module has its own fleet: 4 producers with the fake's prefix cache at 160 blocks of 16
tokens (2,560 tokens, 10,240 characters: two 3,900-character system prompts fit, three do not)
and 2 consumers. Each test makes prefixes of its own (a fresh tag), so their holdings are theirs. Every producer
prefills at the same cost (10 µs an uncached token), and the router runs with
``affinity_slack = 3`` (``SLACK``): the rank (what these tests predict) must decide between equal
producers that hold nothing. Equal producers are placed at one rate (the learned rates' mean at
each one's engine-reported class, ``supervisor.holdings.rate``); before that, rates learned from
10 ms prefills were mostly the round trip's noise (identical fakes read 141,000–298,000
characters a second under two busy loops on a 2-core machine, and with a slack of 0.5 the noise
decided 3 runs of 4). The slack keeps a class misread under such load (½: a doubled estimate)
from deciding either. A holder (nothing to compute) or a prefix's home still wins outright: its
estimate is near zero. The tests of the rate run their own routers, with a producer 10× slower.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    access_line,
    completion,
    engine_entry,
    scrape,
    send,
    settled,
    start_router,
    value,
)

PRODUCERS = ["hp0", "hp1", "hp2", "hp3"]
CONSUMERS = ["hd0", "hd1"]
PREFIX_CHARS = 3900  # 15 blocks of 256; a prompt of it and a short question keys exactly those
BLOCKS = PREFIX_CHARS // 256
KV_BLOCKS = 160
SLACK = 3.0  # candidates within 4× of the best estimate go by rank (the module docstring says why)


def engines() -> list[dict[str, Any]]:
    """The router's ``[[engines]]``."""
    return [{"name": n, "role": "producer"} for n in PRODUCERS] + [{"name": n, "role": "consumer"} for n in CONSUMERS]


def start_fleet(version: str | None = None) -> FakeFleet:
    """The holdings tests' fakes: 4 producers with a 160-block prefix cache, 2 consumers, of vLLM
    ``version`` (None: the fake's default, 0.33.0)."""
    release = ["--vllm-version", version] if version else []
    return FakeFleet.start(PRODUCERS + CONSUMERS, args=["--model", MODEL, "--lease-s", "120", "--prefix-cache",
                                                        "--kv-blocks", str(KV_BLOCKS), "--prefill-us-per-token", "10",
                                                        *release])


def module_fleet(version: str | None = None) -> Iterator[FakeFleet]:
    """The module's fleet (a module-scoped fixture's body)."""
    started = start_fleet(version)
    yield started
    started.stop()


def fresh_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, FakeFleet]]:
    """A fleet and router of their own, nothing held and nothing learned: for the tests whose
    choices depend on which producers are full or live, which a module's shared fleet fills as
    its tests go."""
    fakes = start_fleet()
    try:
        proc = start(fakes, tmp_path_factory.mktemp("fresh"))
        yield proc, fakes
        proc.stop()
    finally:
        fakes.stop()


def start(hfleet: FakeFleet, tmp: Any, workers: int = 2, held: dict[str, Any] | None = None,
          **placement: Any) -> RouterProcess:
    """A router over the holdings fleet (``[placement.held]`` ``affinity_slack`` ``SLACK``: the
    module docstring says why; ``held``: more of that table, ``placement``: of ``[placement]``).
    Every request goes to a producer (``skip_prefill_share`` 0) unless a test asks otherwise: these
    tests repeat prompts to see what producers hold, and a consumer that decoded one would take
    the repeat alone."""
    return start_router(hfleet, engines(), tmp, server={"workers": workers, "admin_token": TOKEN},
                        placement={"load_interval_s": 0.1, "skip_prefill_share": 0,
                                   "held": {"affinity_slack": SLACK, **(held or {})}, **placement})


def module_router(hfleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """The module's router over its fleet (a module-scoped fixture's body)."""
    proc = start(hfleet, tmp_path_factory.mktemp("holdings"))
    yield proc
    proc.stop()


def make_prefix(tag: str | None = None) -> str:
    """A system prompt of PREFIX_CHARS characters, its own by ``tag`` (a fresh one by default)."""
    tag = tag or uuid.uuid4().hex
    text = tag + " " + "".join(f"system rule {i:03d}: answer as the house style says. " for i in range(100))
    return text[:PREFIX_CHARS]


def favourites(prefix: str) -> list[str]:
    """The producers in rendezvous rank of the prompt's first block key: who places it first."""
    return rank(list(PRODUCERS), PrefixBlocks(prefix, 256, 65536).key(0), key_hash)


async def ask(session: aiohttp.ClientSession, router: RouterProcess, prompt: str) -> dict[str, Any]:
    """One completion through ``session``'s worker; its access-log line."""
    rid = f"held-{uuid.uuid4().hex}"
    async with session.post(router.url + "/v1/completions", json=completion(prompt, stream=False),
                            headers={"x-request-id": rid}) as resp:
        assert resp.status == 200, await resp.read()
    return access_line(router, rid)


async def holdings(router: RouterProcess, name: str) -> dict[str, Any]:
    """``/admin/engines``' ``holdings`` of ``name`` (nothing published: no blocks)."""
    entry = await engine_entry(router, name)
    return dict(entry["holdings"] or {"blocks": 0, "capacity_blocks": None})


async def wait_blocks(router: RouterProcess, name: str, check: Any, what: str, timeout: float = 10) -> dict:
    """Until ``name``'s published blocks pass ``check`` (bounded by ``timeout``); its holdings."""
    end = asyncio.get_running_loop().time() + timeout
    while True:
        held = await holdings(router, name)
        if check(held["blocks"]):
            return held
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"{name}: {what}; holdings {held}")
        await asyncio.sleep(0.05)


async def chat_turn(router: RouterProcess, body: dict[str, Any], tag: str) -> dict[str, Any]:
    """One chat turn through ``router`` (a 200, or the test fails): its access-log line."""
    rid = f"{tag}-{uuid.uuid4().hex}"
    reply = await send(router.url, "/v1/chat/completions", body, headers={"x-request-id": rid})
    assert reply.status == 200, reply.raw
    return access_line(router, rid)


def prefills(fleet: FakeFleet) -> dict[str, int]:
    """Each producer's prefills so far (the fakes' own counters)."""
    return {name: fleet.stats(name)["requests"]["prefill"] for name in PRODUCERS}


def predictions(router: RouterProcess) -> dict[str, float]:
    """``narwhal_holdings_predictions_total`` by result."""
    text = scrape(router)
    return {r: value(text, "narwhal_holdings_predictions_total", result=r) for r in ("exact", "over", "under")}


def delta(router: RouterProcess, before: dict[str, float], expected: dict[str, float]) -> dict[str, float]:
    """The predictions counted since ``before``, once they settle (on ``expected``, or time)."""
    def read() -> dict[str, float]:
        now = predictions(router)
        return {r: now[r] - before[r] for r in now}

    return dict(settled(read, expected))


