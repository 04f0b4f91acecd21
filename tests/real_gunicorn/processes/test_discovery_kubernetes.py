"""Kubernetes discovery (docs/behaviour.md "Engines that come and go", docs/deploy.md "Kubernetes discovery")
through real gunicorn and the real client library (``kubernetes_asyncio``) against a small API
server on 127.0.0.1 (``tests/kube_api.py``): ready endpoints join, one that turns ready joins
within a watch event and its first checks, one deleted mid-stream drains without cutting its
stream, a 410 relists, and an API server that goes away changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles
from tests.kube_api import KubeApi, endpoint_slice
from tests.real_gunicorn.support import TOKEN, admin, completion, send, start_router, unique_prompt

pytestmark = pytest.mark.timeout(120)

PREFILL = {"app": "vllm-prefill"}
DECODE = {"app": "vllm-decode"}


@pytest.fixture(scope="module")
def kfleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(["kp0", "kp1", "kd0", "kd1"], args=["--model", "fake-model", "--lease-s", "60"])
    yield fleet
    fleet.stop()


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi()
    server.start()
    yield server
    server.close()


def _router(fleet: FakeFleet, api: KubeApi, tmp: Path) -> RouterProcess:
    kube = {"namespace": "llm", "producer_selector": "app=vllm-prefill", "consumer_selector": "app=vllm-decode",
            "kubeconfig": api.kubeconfig(tmp / "kubeconfig.json")}
    return start_router(fleet, [], tmp, server={"workers": 2, "admin_token": TOKEN},
                        discovery={"interval_s": 30, "kubernetes": kube}, log={"level": "info"},
                        recovery={"eject_after": 1000, "max_migrations": 0, "health_interval_s": 0.5})


async def _states(router: RouterProcess) -> dict[str, str]:
    return {e["name"]: e["state"] for e in (await admin(router))["engines"]}


async def _until(router: RouterProcess, check: Any, what: str, timeout: float = 15) -> dict[str, str]:
    end = time.monotonic() + timeout
    while True:
        states = await _states(router)
        if check(states):
            return states
        if time.monotonic() > end:
            raise AssertionError(f"{what}: {states}")
        await asyncio.sleep(0.05)


async def _listed_pair(fleet: FakeFleet, api: KubeApi, tmp: Path) -> RouterProcess:
    """A router over one ready producer pod (kp0) and one ready consumer pod (kd0), both admitted."""
    api.put(endpoint_slice("prefill-a", PREFILL, fleet.engines["kp0"], "kp0"))
    api.put(endpoint_slice("decode-a", DECODE, fleet.engines["kd0"], "kd0"))
    router = _router(fleet, api, tmp)
    try:
        await _until(router, lambda s: s.get("kp0") == "admitted" and s.get("kd0") == "admitted", "listed pods joined")
    except BaseException:
        router.stop()
        raise
    return router


async def test_ready_pods_join_a_deleted_one_drains_its_stream_and_a_410_relists(
    kfleet: FakeFleet, api: KubeApi, tmp_path: Path
) -> None:
    api.put(endpoint_slice("prefill-a", PREFILL, kfleet.engines["kp0"], "kp0"))
    api.put(endpoint_slice("decode-a", DECODE, kfleet.engines["kd0"], "kd0"))
    api.put(endpoint_slice("decode-b", DECODE, kfleet.engines["kd1"], "kd1", ready=False))  # not ready: not an engine
    router = _router(kfleet, api, tmp_path)
    try:
        await _until(router, lambda s: s.get("kp0") == "admitted" and s.get("kd0") == "admitted", "listed pods joined")
        assert "kd1" not in await _states(router)
        reply = await send(router.url, "/v1/completions", completion(unique_prompt(), stream=False))
        assert reply.status == 200, reply.raw

        # A pod that turns ready joins within one watch event and its first checks, not the 30 s interval.
        started = time.monotonic()
        api.put(endpoint_slice("decode-b", DECODE, kfleet.engines["kd1"], "kd1"))
        await _until(router, lambda s: s.get("kd1") == "admitted", "the ready pod joined")
        assert time.monotonic() - started < 10

        # A pod deleted mid-stream drains: no new placements, its stream finishes whole.
        body = completion(unique_prompt(), max_tokens=60, fake={"decode": {"token_delay_s": 0.1}})
        async with aiohttp.ClientSession() as session, session.post(
                router.url + "/v1/completions", json=body, headers={"x-request-id": "kube-drain"}) as resp:
            assert resp.status == 200
            await resp.content.readany()
            engines = (await admin(router))["engines"]
            name = next(e["name"] for e in engines if e["name"] in ("kd0", "kd1") and e["inflight"]["decode"])
            gone = "decode-a" if name == "kd0" else "decode-b"
            api.delete(gone)
            await _until(router, lambda s: s.get(name) == "draining", "the deleted pod draining")
            text = (await resp.read()).decode()
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        await _until(router, lambda s: name not in s, "the drained pod forgotten")

        # 410 Gone: every version so far compacted away, the watch dropped: the router lists again.
        lists = api.requests.count("list")
        api.compact()
        api.drop_watches()
        api.put(endpoint_slice("prefill-b", PREFILL, kfleet.engines["kp1"], "kp1"))
        await _until(router, lambda s: s.get("kp1") == "admitted", "the pod added after the 410 joined")
        assert api.requests.count("list") > lists
        assert "(410 Gone): listing again" in router.log_text()

        # Hostile answers are refused with one line each; the supervisor keeps its pid, the fleet its engines.
        supervisor = router_roles(router.proc.pid)["supervisor"]
        bad = endpoint_slice("prefill-bad", PREFILL, kfleet.engines["kp1"], "kp9")
        bad["endpoints"][0]["addresses"] = ["not-an-address"]
        api.put(bad)
        api.put({"metadata": {"name": "prefill-worse", "labels": PREFILL}, "addressType": "IPv4", "endpoints": 7,
                 "ports": "none"})
        end = time.monotonic() + 10
        while router.log_text().count("refused: ") < 2:
            assert time.monotonic() < end, router.log_text()[-2000:]
            await asyncio.sleep(0.05)
        log_text = router.log_text()
        assert "EndpointSlice 'prefill-bad' (producer) refused: address 'not-an-address' is not an IP" in log_text
        assert "EndpointSlice 'prefill-worse' (producer) refused: no port named 'http'" in log_text
        assert "not answering" not in router.log_text()  # one slice refused, not the source
        assert router_roles(router.proc.pid)["supervisor"] == supervisor
        # The same engines (a worker that has not read kp1's models yet shows it probing: the names are what counts).
        assert sorted(n for n in await _states(router) if n.startswith("kp")) == ["kp0", "kp1"]
    finally:
        router.stop()


async def test_an_api_server_that_goes_away_changes_nothing_and_is_said_once(
    kfleet: FakeFleet, api: KubeApi, tmp_path: Path
) -> None:
    router = await _listed_pair(kfleet, api, tmp_path)
    try:
        api.stop()
        deadline = time.monotonic() + 10
        while "kubernetes API server not answering" not in router.log_text():
            assert time.monotonic() < deadline, router.log_text()[-2000:]
            await asyncio.sleep(0.05)
        for _ in range(10):  # meanwhile every request is served by the last membership
            reply = await send(router.url, "/v1/completions", completion(unique_prompt(), stream=False))
            assert reply.status == 200, reply.raw
        await asyncio.sleep(1.5)  # retries with backoff meanwhile (0.5 s, 1 s …): still said once
        assert router.log_text().count("kubernetes API server not answering") == 1
        assert sorted(await _states(router)) == ["kd0", "kp0"]  # the last membership kept
        api.start()
        deadline = time.monotonic() + 40
        while "kubernetes API server answering again" not in router.log_text():
            assert time.monotonic() < deadline, router.log_text()[-2000:]
            await asyncio.sleep(0.1)
    finally:
        router.stop()


async def test_a_watch_resumes_from_its_last_bookmark_without_listing_again(
    kfleet: FakeFleet, api: KubeApi, tmp_path: Path
) -> None:
    # Bookmarks are asked for (allowWatchBookmarks) and taken: a watch that saw only other
    # objects' changes resumes from the bookmark's version, which the API server still has,
    # rather than from an older one it compacted away (a 410 and a relist of every slice).
    router = await _listed_pair(kfleet, api, tmp_path)
    try:
        lists, watches = api.requests.count("list"), len(api.watched_from)
        assert watches == 2  # one per role
        for i in range(5):  # changes neither watch is shown: the versions move on without them
            api.put(endpoint_slice(f"other-{i}", {"app": "other"}, kfleet.engines["kp1"], f"x{i}"))
        api.bookmark()
        marked = api.version
        end = time.monotonic() + 10
        while api.bookmarks_sent < 2:  # written to both watches
            assert time.monotonic() < end, "the bookmark never reached the watches"
            await asyncio.sleep(0.02)
        api.compact(through=marked - 1)  # every version before the bookmark is gone
        api.drop_watches()
        end = time.monotonic() + 10
        while len(api.watched_from) < watches + 2:
            assert time.monotonic() < end, f"the watches did not resume: {api.requests}"
            await asyncio.sleep(0.02)
        assert api.watched_from[watches:] == [marked, marked]
        assert api.requests.count("list") == lists
        assert "(410 Gone)" not in router.log_text()
        assert sorted(await _states(router)) == ["kd0", "kp0"]
    finally:
        router.stop()
