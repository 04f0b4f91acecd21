"""Engines that come and go (docs/behaviour.md "Engines that come and go") through real gunicorn: a watched file edited
on disk, a
real DNS server process on 127.0.0.1; no worker restarts, no lost request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.testing.harness import DeadEngine, FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    AUTH,
    TOKEN,
    admin,
    completion,
    records,
    scrape,
    send,
    sessions_per_worker,
    start_router,
    unique_prompt,
    value,
    wait_until,
    workers_of,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
STATIC = [{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"}]
WORKERS = 2


def write_engines(path: Path, entries: list[dict[str, Any]]) -> None:
    lines = []
    for entry in entries:
        lines.append("[[engines]]")
        lines += [f'{k} = "{v}"' for k, v in entry.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # atomically, as an operator's tooling (or a ConfigMap) does


def entry(fleet: FakeFleet, name: str, role: str) -> dict[str, str]:
    return {"name": name, "url": fleet.engines[name], "role": role}


def discovering_router(fleet: FakeFleet, tmp: Path, engines_file: Path, **discovery: Any) -> RouterProcess:
    return start_router(fleet, [dict(e) for e in STATIC], tmp, server={"workers": WORKERS, "admin_token": TOKEN},
                        discovery={"file": str(engines_file), "interval_s": 0.2, **discovery},
                        log={"level": "info"})


async def names(router: RouterProcess) -> dict[str, str]:
    return {e["name"]: e["state"] for e in (await admin(router))["engines"]}


async def views(router: RouterProcess) -> list[dict[str, str]]:
    """Each worker's /admin/engines, by name: a worker takes a change up within
    ``following.FOLLOW_S`` of another, so a wait ends only when every worker shows it."""
    async with sessions_per_worker(router, WORKERS) as sessions:
        out = []
        for session in sessions.values():
            async with session.get(router.url + "/admin/engines", headers=AUTH) as resp:
                assert resp.status == 200, await resp.text()
                out.append({e["name"]: e["state"] for e in (await resp.json())["engines"]})
        return out


async def wait_listed(router: RouterProcess, name: str, state: str, timeout: float = 20) -> None:
    """Until ``name`` is in every worker's /admin/engines in ``state`` (absent at first: it is discovered)."""
    end = asyncio.get_running_loop().time() + timeout
    seen: list[dict[str, str]] = []
    while asyncio.get_running_loop().time() < end:
        seen = await views(router)
        if all(view.get(name) == state for view in seen):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never {state} in every worker's /admin/engines: {seen}")


async def wait_ready_everywhere(router: RouterProcess, timeout: float = 10) -> None:
    """Until every worker answers /ready 200 (each takes a new engine's models up from the
    supervisor's records after taking the engine up: ``worker.models_follow``)."""
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        async with sessions_per_worker(router, WORKERS) as sessions:
            statuses = []
            for session in sessions.values():
                async with session.get(router.url + "/ready") as resp:
                    statuses.append(resp.status)
        if statuses == [200] * WORKERS:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not every worker ready: {statuses}")


async def wait_gone(router: RouterProcess, name: str, timeout: float = 20) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        if all(name not in view for view in await views(router)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} still in some worker's /admin/engines: {await views(router)}")


async def served_by(router: RouterProcess, fleet: FakeFleet, name: str, timeout: float = 15) -> None:
    """Until a request lands on engine ``name``: a new prompt each time, since a prompt's prefix
    keeps going to the producer placement chose for it."""
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        prompt = unique_prompt()
        assert (await send(router.url, "/v1/completions", completion(prompt))).status == 200
        if records(fleet, name, prompt):
            return
    raise AssertionError(f"no request reached {name} in {timeout:g}s")


async def light_load(router: RouterProcess, statuses: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=8))
        statuses.append(reply.status)


async def test_engines_join_and_leave_on_a_file_edit_under_load_losing_no_request(
    fleet: FakeFleet, tmp_path: Path
) -> None:
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "p1", "producer")])
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "p1", "admitted")
        statuses: list[int] = []
        stop = asyncio.Event()
        load = [asyncio.ensure_future(light_load(router, statuses, stop)) for _ in range(2)]
        write_engines(engines_file, [entry(fleet, "p1", "producer"), entry(fleet, "d1", "consumer")])
        await wait_listed(router, "d1", "admitted")
        await served_by(router, fleet, "d1")  # every worker knows d1's model within a second or so
        write_engines(engines_file, [entry(fleet, "d1", "consumer")])  # p1 goes: drained, then forgotten
        await wait_gone(router, "p1")
        stop.set()
        await asyncio.gather(*load)
        assert statuses and set(statuses) == {200}
        text = router.log_text()
        assert "engine p1 at " + fleet.engines["p1"] + " drained and forgotten" in text
        # Each worker drops it within a follow period of the supervisor forgetting it.
        wait_until(lambda: all('engine="p1"' not in scrape(router) for _ in range(4)), 5, "p1's series gone")
        metrics = scrape(router)
        assert 'narwhal_engine_state{engine="d1",role="consumer"} 0.0' in metrics
        assert value(metrics, "narwhal_discovery_engines", source="file", state="active") == 1
        assert value(metrics, "narwhal_discovery_engines", source="file", state="draining") == 0
    finally:
        router.stop()


async def test_a_file_made_invalid_or_removed_keeps_the_last_good_set(fleet: FakeFleet, tmp_path: Path) -> None:
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "p1", "producer")])
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "p1", "admitted")
        write_engines(engines_file, [entry(fleet, "p1", "producer"), {"url": fleet.engines["d1"], "role": "decoder"}])
        line = (f"discovery: file refused, keeping its last good set (1 engines): {engines_file}: "
                "engines.1.role: Input should be 'producer', 'consumer' or 'both'")
        wait_until(lambda: line in router.log_text(), 10, "the refusal, naming entry and key")
        engines_file.unlink()
        wait_until(lambda: f"discovery: file unreadable, keeping its last good set (1 engines): cannot read "
                           f"{engines_file}: No such file or directory" in router.log_text(), 10, "the warning")
        assert router.log_text().count(line) == 1  # one warning per source per minute
        assert (await names(router)) == {"p0": "admitted", "d0": "admitted", "p1": "admitted"}
        await served_by(router, fleet, "p1")
    finally:
        router.stop()


async def test_more_engines_than_slots_are_refused_with_one_line_and_counted(
    fleet: FakeFleet, tmp_path: Path
) -> None:
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "p1", "producer"), entry(fleet, "d1", "consumer")])
    router = discovering_router(fleet, tmp_path, engines_file, max_engines=3)
    try:
        await wait_listed(router, "p1", "admitted")
        line = (f"discovery: file: engine 'd1' at {fleet.engines['d1']} is refused: "
                "all 3 engine slots are taken (discovery.max_engines)")
        wait_until(lambda: line in router.log_text(), 10, "the refusal")
        def counted() -> bool:
            metrics = scrape(router)
            return [value(metrics, "narwhal_discovery_engines", source="file", state=state)
                    for state in ("active", "probing", "draining", "refused")] == [1, 0, 0, 1]

        wait_until(counted, 5, "p1 active and d1 refused in narwhal_discovery_engines")
        assert router.log_text().count(line) == 1  # once per change, not per read
        assert "d1" not in await names(router)
    finally:
        router.stop()


async def test_an_engine_waiting_for_a_slot_joins_when_its_old_self_is_forgotten(
    fleet: FakeFleet, tmp_path: Path
) -> None:
    """At ``max_engines``, a pod replaced under a new IP (p1 moves to p2's URL)
    waits while its old self drains, and joins once that one is forgotten, with no further change
    of the file: the join is tried again every interval while something waits."""
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "p1", "producer")])
    router = discovering_router(fleet, tmp_path, engines_file, max_engines=3)
    try:
        await wait_listed(router, "p1", "admitted")
        write_engines(engines_file, [{"name": "p1", "url": fleet.engines["p2"], "role": "producer"}])
        line = (f"discovery: file: engine 'p1' at {fleet.engines['p2']} is refused: its name is still "
                f"{fleet.engines['p1']}'s, draining; it joins when a slot frees")
        wait_until(lambda: line in router.log_text(), 10, "the replacement deferred")

        async def p1_at_p2() -> bool:
            return all(e["url"] == fleet.engines["p2"] and e["state"] == "admitted"
                       for e in (await admin(router))["engines"] if e["name"] == "p1")

        end = asyncio.get_running_loop().time() + 20
        while not await p1_at_p2():
            assert asyncio.get_running_loop().time() < end, await admin(router)
            await asyncio.sleep(0.05)
        await wait_listed(router, "p1", "admitted")
        await served_by(router, fleet, "p2")
        assert router.log_text().count(line) == 1  # said once, not every interval it waited
    finally:
        router.stop()


async def test_admitted_in_the_admin_api_means_placement_uses_it(fleet: FakeFleet, tmp_path: Path) -> None:
    """A discovered consumer showed ``admitted`` before the workers had its
    models, and 40 requests sent at once all went to the other one. Now every worker's answer
    says ``admitted`` only once its placement can use the engine: with d0 busy (another
    replica's load), the requests right after go to d1."""
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [])
    fleet.set_background("d0", 4, hold_s=30)
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        write_engines(engines_file, [entry(fleet, "d1", "consumer")])
        await wait_listed(router, "d1", "admitted")
        hits = 0
        for _ in range(40):
            prompt = unique_prompt()
            assert (await send(router.url, "/v1/completions", completion(prompt))).status == 200
            hits += len(records(fleet, "d1", prompt))
        assert hits >= 36, hits  # 0 before: "admitted" came before the workers could place on it
    finally:
        router.stop()
        fleet.control_request("DELETE", "/engines/d0/background")


async def test_a_discovered_producer_has_holdings(fleet: FakeFleet, tmp_path: Path) -> None:
    """The holdings region had a section per configured engine only, and none
    at all with discovery, so ``held`` placed discovered producers by queued work and rank alone.
    Its sections are now one per engine slot: a producer that joins is learned like any other."""
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "p1", "producer")])
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "p1", "admitted")
        await admin(router, "POST", "/admin/engines/p0/eject")  # every prefill on p1
        system = "You are a careful assistant. " * 40  # 1,160 characters: 4 blocks of 256
        for _ in range(2):
            reply = await send(router.url, "/v1/completions", completion(system + unique_prompt()))
            assert reply.status == 200, reply.raw

        async def p1_holdings() -> dict[str, Any] | None:
            return next(e for e in (await admin(router))["engines"] if e["name"] == "p1")["holdings"]

        end = asyncio.get_running_loop().time() + 10
        while not ((held := await p1_holdings()) and held["blocks"] >= 4):
            assert asyncio.get_running_loop().time() < end, held
            await asyncio.sleep(0.05)
    finally:
        router.stop()


# ------------------------------------------------------------------------------------------ DNS


@contextlib.contextmanager
def dns_server(records: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """The real DNS server process of ``tests.dns_server``, serving ``records`` (re-read per query)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.dns_server", str(records)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        first = proc.stdout.readline()  # once bound, or EOF if it died
        assert first.startswith("PORT "), first
        yield int(first.split()[1]), proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def one_port_on(*hosts: str) -> int:
    """A TCP port free on every one of ``hosts`` (a headless Service's pods share one port)."""
    while True:
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    with socket.socket() as other:
                        other.bind((host, port))
            except OSError:
                continue
            return port


def set_records(path: Path, records: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records))
    os.replace(tmp, path)


async def test_dns_a_records_are_engines_and_a_dns_server_gone_keeps_the_last_good_set(
    fleet: FakeFleet, tmp_path: Path
) -> None:
    hosts = ("127.0.0.2", "127.0.0.3")
    port = one_port_on(*hosts)
    pods = [FakeFleet.start(["pod"], args=["--host", host, "--port", str(port)]) for host in hosts]
    records = tmp_path / "records.json"
    set_records(records, {"vllm-decode.test.": {"A": ["127.0.0.2"]}})
    names_of = [f"consumer-{host}-{port}" for host in hosts]
    try:
        with dns_server(records) as (dns_port, proc):
            router = start_router(
                fleet, [dict(e) for e in STATIC], tmp_path, server={"workers": WORKERS, "admin_token": TOKEN},
                log={"level": "info"},
                discovery={"interval_s": 0.2, "resolver": f"127.0.0.1:{dns_port}",
                           "dns": [{"name": "vllm-decode.test", "port": port, "role": "consumer"}]})
            try:
                await wait_listed(router, names_of[0], "admitted")
                set_records(records, {"vllm-decode.test.": {"A": list(hosts)}})  # scaled up
                await wait_listed(router, names_of[1], "admitted")
                await served_by(router, pods[1], "pod")
                wait_until(lambda: value(scrape(router), "narwhal_discovery_engines", source="dns",
                                         state="active") == 2, 5, "two engines active from DNS")
                proc.terminate()
                proc.wait(timeout=10)
                wait_until(lambda: "discovery: dns:vllm-decode.test unreadable, keeping its last good set "
                                   "(2 engines): DNS A vllm-decode.test: " in router.log_text(), 15, "the warning")
                listed = await names(router)
                assert [listed.get(n) for n in names_of] == ["admitted", "admitted"]
                await served_by(router, pods[0], "pod")
            finally:
                router.stop()
    finally:
        for pod in pods:
            pod.stop()


async def test_a_reload_keeps_the_discovered_engines(fleet: FakeFleet, tmp_path: Path) -> None:
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "p1", "producer")])
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "p1", "admitted")
        old = workers_of(router)
        os.kill(router.proc.pid, signal.SIGHUP)
        wait_until(lambda: len(workers_of(router) - old) == 2 and not old & workers_of(router), 30,
                   "two new workers, the old ones gone")
        assert (await names(router)) == {"p0": "admitted", "d0": "admitted", "p1": "admitted"}
        await served_by(router, fleet, "p1")
        assert "drained and forgotten" not in router.log_text()
    finally:
        router.stop()


async def test_a_vanished_engine_drains_its_streams_before_it_is_forgotten(fleet: FakeFleet, tmp_path: Path) -> None:
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [entry(fleet, "d1", "consumer")])
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "d1", "admitted")
        await admin(router, "POST", "/admin/engines/d0/eject")  # every decode goes to d1 now
        # Each worker has d1's models within 0.25 s of the supervisor's read: until then, 503.
        await wait_ready_everywhere(router)
        async with aiohttp.ClientSession() as session:
            body = completion(unique_prompt(), max_tokens=30, fake={"decode": {"token_delay_s": 0.1}})
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readany()  # the first token: the stream is on d1
                write_engines(engines_file, [])  # d1 goes while it streams
                await wait_listed(router, "d1", "draining")
                rest = await resp.content.read()
        assert rest.rstrip().endswith(b"data: [DONE]")  # its in-flight leg finished
        await wait_gone(router, "d1")
        assert "engine d1 at " + fleet.engines["d1"] + " drained and forgotten" in router.log_text()
    finally:
        router.stop()


async def test_a_new_engine_failing_its_checks_stays_probing_and_takes_no_request(
    fleet: FakeFleet, tmp_path: Path
) -> None:
    dead = DeadEngine(refusing=True)
    engines_file = tmp_path / "engines.toml"
    write_engines(engines_file, [{"name": "gone", "url": dead.url, "role": "consumer"}])
    router = discovering_router(fleet, tmp_path, engines_file)
    try:
        await wait_listed(router, "gone", "probing")
        wait_until(lambda: "probe of gone (lifecycle): fail: health: " in router.log_text(), 10, "its check failed")
        wait_until(lambda: value(scrape(router), "narwhal_discovery_engines", source="file", state="probing") == 1,
                   5, "counted as probing")
        for _ in range(6):  # every request goes to d0 meanwhile
            assert (await send(router.url, "/v1/completions", completion(unique_prompt()))).status == 200
        assert (await names(router))["gone"] == "probing"  # never ejected: it never served
    finally:
        router.stop()
        dead.close()
