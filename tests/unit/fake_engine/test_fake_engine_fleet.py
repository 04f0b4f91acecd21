"""The fake engine's stats, records and aborts, and the fleet process with its control API and CLI."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient

from narwhal.fake_engine import FakeEngine, Fleet, build_engine_app
from tests.unit.fake_engine.fe_support import (
    ROOT,
    ClientFactory,
    decoded,
    faulty,
    prefill_body,
    two_engines,
    wait_for,
)
from tests.wire import PREFILL_KV

# -- stats, records, aborts --------------------------------------------------------------------


async def test_stats_and_records(client: TestClient[Any, Any], engine: FakeEngine) -> None:
    headers = {
        "X-Request-Id": "rid-1",
        "Authorization": "Bearer k",
        "traceparent": "00-abc-def-01",
        "X-Other": "no",
    }
    await (await client.post("/v1/completions", json=prefill_body(), headers=headers)).read()
    await (await client.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 2})).read()
    # A same-engine warm-up prefill: no kv_transfer_params, max_tokens 1, ignore_eos.
    await (
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "ignore_eos": True})
    ).read()
    stats = engine.stats()
    assert stats["requests"] == {"prefill": 2, "decode": 1, "total": 3}
    assert stats["completed_streams"] == 1 and stats["active_streams"] == 0 and stats["aborted_streams"] == 0
    rec = engine.get_records()[0]
    assert rec["phase"] == "prefill" and rec["path"] == "/v1/completions" and rec["outcome"] == "completed"
    assert rec["headers"] == {
        "x-request-id": "rid-1",
        "authorization": "Bearer k",
        "traceparent": "00-abc-def-01",
        "content-type": "application/json",
    }
    assert rec["body"]["kv_transfer_params"] == PREFILL_KV and isinstance(rec["t"], float)
    assert len(engine.get_records('"stream":true')) == 1
    engine.clear_records()
    assert engine.get_records() == []


def test_records_past_the_bound_are_dropped_and_counted() -> None:
    engine = FakeEngine("bounded", records_max=2)
    for i in range(3):
        engine.record("prefill", "/v1/completions", {"x-request-id": f"r{i}"}, {})
    assert [r["headers"]["x-request-id"] for r in engine.get_records()] == ["r1", "r2"]
    assert engine.stats()["records_dropped"] == 1


async def test_aborted_stream_when_client_disconnects(
    client: TestClient[Any, Any], engine: FakeEngine
) -> None:
    resp = await client.post("/v1/completions", json=faulty({"tokens": 200, "token_delay_s": 0.02}))
    await resp.content.readuntil(b"\n\n")
    assert engine.stats()["active_streams"] == 1
    resp.close()
    await wait_for(lambda: engine.aborted_streams == 1)
    assert engine.stats()["active_streams"] == 0 and engine.completed_streams == 0
    assert engine.get_records()[-1]["outcome"] == "aborted"


async def test_abort_before_pull_releases_producer(aiohttp_client: ClientFactory) -> None:
    producer, consumer, pc, dc = await two_engines(aiohttp_client)
    desc = (await (await pc.post("/v1/completions", json=prefill_body(32))).json())["kv_transfer_params"]
    body = faulty({"delay_headers_s": 5}, kv_transfer_params=desc)
    with pytest.raises(asyncio.TimeoutError):
        await dc.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))
    await wait_for(lambda: producer.kv.held_blocks == 0)
    assert consumer.aborted_streams == 1 and producer.kv.kv_reads == 1


@pytest.mark.parametrize(
    "spec",
    [{}, {"token_delay_s": 0.01, "silence_after": 2, "silence_s": 0.25, "heartbeat_s": 0.1}],
    ids=["no-delay", "delays"],
)
async def test_coalesced_stream_is_identical(aiohttp_client: ClientFactory, spec: dict[str, Any]) -> None:
    c = await aiohttp_client(build_engine_app(FakeEngine("c", coalesce=True)))
    body = faulty(spec, max_tokens=5, stream_options={"include_usage": True})
    evs = decoded(await (await c.post("/v1/completions", json=body)).read())
    texts = [e["choices"][0]["text"] for e in evs[:-1] if e["choices"]]
    assert texts == [f" t{i}" for i in range(5)] and evs[-1] == "[DONE]"
    assert evs[-2]["usage"]["completion_tokens"] == 5
    beats = [e for e in evs[:-2] if not e["choices"]]
    assert (len(beats) >= 1) if spec else not beats


# -- fleet and control server ------------------------------------------------------------------


@pytest.fixture
async def running() -> AsyncIterator[tuple[Fleet, dict[str, Any], aiohttp.ClientSession]]:
    """A two-engine fleet (a, b) with its control server, in process, and a client session."""
    fleet = Fleet(["a", "b"], lease_s=30)
    ready = await fleet.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield fleet, ready, session
    finally:
        await fleet.close()


async def test_fleet_control_routes_set_faults_and_show_requests_and_holdings(
    running: tuple[Fleet, dict[str, Any], aiohttp.ClientSession],
) -> None:
    fleet, ready, s = running
    ctl = ready["control"]
    put = await s.put(f"{ctl}/engines/a/faults", json={"decode": {"status": 429}, "kv_read_fails": True})
    assert (await put.json())["faults"]["decode"] == {"status": 429}
    assert (await s.put(f"{ctl}/engines/a/faults", json={"bogus": 1})).status == 400
    assert (await s.get(f"{ctl}/engines/zzz/stats")).status == 404
    resp = await s.post(f"{ready['engines']['a']}/v1/completions", json={"prompt": "x"})
    assert resp.status == 429
    reqs = await (await s.get(f"{ctl}/engines/a/requests", params={"contains": '"prompt":"x"'})).json()
    assert reqs["count"] == 1 and reqs["requests"][0]["status"] == 429
    assert (await (await s.delete(f"{ctl}/engines/a/faults")).json())["faults"] == {}
    # Crossed handoff a -> b through the control-visible stats.
    pre = await (await s.post(f"{ready['engines']['a']}/v1/completions", json=prefill_body(32))).json()
    everything = await (await s.get(f"{ctl}/engines")).json()
    assert everything["a"]["held_blocks"] == 2 and set(everything) == {"a", "b"}
    body = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": pre["kv_transfer_params"]}
    assert (await s.post(f"{ready['engines']['b']}/v1/completions", json=body)).status == 200
    assert (await (await s.get(f"{ctl}/engines/a/stats")).json())["held_blocks"] == 0
    assert (await (await s.post(f"{ctl}/reset")).json()) == {"reset": ["a", "b"]}
    assert (await (await s.delete(f"{ctl}/engines/b/requests")).json())["cleared"] == 0


async def test_fleet_control_stops_and_starts_an_engine_and_an_abort_is_counted(
    running: tuple[Fleet, dict[str, Any], aiohttp.ClientSession],
) -> None:
    fleet, ready, s = running
    ctl, b_url = ready["control"], ready["engines"]["b"]
    # The real AppRunner cancels the handler of a stream whose client went away.
    stream = await s.post(f"{b_url}/v1/completions", json=faulty({"tokens": 100, "token_delay_s": 0.05}))
    await stream.content.readuntil(b"\n\n")
    stream.close()
    await wait_for(lambda: fleet.engines["b"].aborted_streams == 1)
    # Stop aborts an open stream and refuses new connections; start listens again.
    stream = await s.post(f"{b_url}/v1/completions", json=faulty({"tokens": 100, "token_delay_s": 0.05}))
    await stream.content.readuntil(b"\n\n")
    stopped = await (await s.post(f"{ctl}/engines/b/stop")).json()
    assert stopped["serving"] is False
    with pytest.raises(aiohttp.ClientPayloadError):
        await stream.read()
    with pytest.raises(aiohttp.ClientConnectorError):
        await s.get(f"{b_url}/health")
    started = await (await s.post(f"{ctl}/engines/b/start")).json()
    assert started == {"name": "b", "serving": True, "url": b_url}
    assert (await s.get(f"{b_url}/health")).status == 200
    # A stopped producer cannot serve reads, even through the in-process registry.
    pre = await (await s.post(f"{b_url}/v1/completions", json=prefill_body(32))).json()
    await s.post(f"{ctl}/engines/b/stop")
    body = {"prompt": "x", "stream": True, "kv_transfer_params": pre["kv_transfer_params"]}
    evs = decoded(await (await s.post(f"{ready['engines']['a']}/v1/completions", json=body)).read())
    assert evs[0]["error"]["message"] == "KV transfer failed" and evs[1:] == ["[DONE]"]
    await s.post(f"{ctl}/engines/b/start")


def _http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None


def test_fleet_process_cli(tmp_path: Path) -> None:
    ready_file = tmp_path / "ready.json"
    code = "from narwhal.fake_engine import main; raise SystemExit(main(sys.argv[1:]))"
    argv = ["--engine", "p0", "--engine", "d0", "--lease-s", "5", "--ready-file", str(ready_file)]
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; {code}", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        readable, _, _ = select.select([proc.stdout], [], [], 15)
        assert readable, "no ready line"
        ready = json.loads(proc.stdout.readline())
        assert set(ready) == {"control", "engines"} and set(ready["engines"]) == {"p0", "d0"}
        assert json.loads(ready_file.read_text()) == ready
        ctl, p0 = ready["control"], ready["engines"]["p0"]
        status, data = _http("POST", f"{p0}/v1/completions", prefill_body(32))
        assert status == 200 and data["kv_transfer_params"]["remote_port"] == int(p0.rsplit(":", 1)[1])
        assert _http("GET", f"{ctl}/engines/p0/stats")[1]["held_blocks"] == 2
        assert _http("POST", f"{ctl}/engines/p0/stop")[1]["serving"] is False
        with pytest.raises(urllib.error.URLError) as info:
            _http("GET", f"{p0}/health")
        assert isinstance(info.value.reason, ConnectionRefusedError)
        assert _http("POST", f"{ctl}/engines/p0/start")[1]["serving"] is True
        assert _http("GET", f"{p0}/health")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        stderr = proc.stderr.read().decode()
        assert "Traceback" not in stderr, stderr
        assert proc.stdout.read() == b""  # exactly one line on stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
async def test_the_engine_listens_with_uvicorns_backlog() -> None:
    # vLLM listens through uvicorn (backlog 2048); with aiohttp's 128 a thousand streams
    # connecting at once were reset by the fake, as no real engine would reset them.
    engine = FakeEngine("e0")
    await engine.start()
    try:
        out = subprocess.run(["ss", "-ltnH", f"sport = :{engine.port}"], capture_output=True, text=True, check=True)
        send_q = [int(line.split()[2]) for line in out.stdout.splitlines() if line.strip()]
        with open("/proc/sys/net/core/somaxconn") as f:  # the kernel caps any backlog at this
            cap = int(f.read())
        assert send_q == [min(2048, cap)]
    finally:
        await engine.close()
