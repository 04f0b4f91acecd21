"""The settings Narwhal ships (``deploy/narwhal.toml`` and the TOML inside the Kubernetes ConfigMap)
start a router under real gunicorn that admits a fleet of vLLM 0.33.0 fakes (docs/decisions.md "vLLM releases": nothing
shipped may pin out a supported release, and the example contract names the release the recipes
run).

Only what cannot work on 127.0.0.1 is replaced: the engines' URLs (the ConfigMap's DNS sources
become static engines with their roles and caps), the bind, the worker count, the admin token and
the access log. Everything else, the pin and ``preflight.on_start`` included, is as shipped."""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from tests.real_gunicorn.support import TOKEN, admin, completion, send, unique_prompt

ROOT = Path(__file__).resolve().parents[3]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the shipped contract's model


def _shipped() -> dict[str, dict[str, Any]]:
    config_map = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text())
    return {"narwhal.toml": tomllib.loads((ROOT / "deploy" / "narwhal.toml").read_text()),
            "configmap": tomllib.loads(config_map["data"]["narwhal.toml"])}


def _engines(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The shipped engines, or one static engine per role for each DNS source (its caps kept)."""
    if settings.get("engines"):
        return [dict(e) for e in settings.pop("engines")]
    engines = []
    for i, source in enumerate(settings["discovery"].pop("dns")):
        keep = {k: v for k, v in source.items() if k not in ("name", "port")}
        engines += [{"name": f"{source['role'][0]}{i}{n}", **keep} for n in range(2)]
    return engines


@pytest.fixture(scope="module", params=sorted(_shipped()))
def shipped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[FakeFleet, RouterProcess, list[dict[str, Any]]]]:
    settings = _shipped()[request.param]
    engines = _engines(settings)
    fleet = FakeFleet.start([e["name"] for e in engines], args=["--model", MODEL, "--enable-scale-out"])
    tmp = tmp_path_factory.mktemp("shipped")
    try:
        for engine in engines:
            engine["url"] = fleet.engines[engine["name"]]
        env = {"NARWHAL_SERVER__WORKERS": "2", "NARWHAL_SERVER__ADMIN_TOKEN": TOKEN,
               "NARWHAL_LOG__ACCESS_LOG": str(tmp / "access.log")}
        router = RouterProcess.start(write_config(engines, settings), env=env, workers=2,
                                     log_path=str(tmp / "router.log"))
        try:
            yield fleet, router, engines
        finally:
            router.stop()
    finally:
        fleet.stop()


async def test_the_shipped_settings_admit_a_fleet_of_the_current_release(
    shipped: tuple[FakeFleet, RouterProcess, list[dict[str, Any]]]
) -> None:
    fleet, router, engines = shipped
    end = time.monotonic() + 15
    while True:  # the supervisor publishes the states and reads the versions as it starts
        listed = {e["name"]: e for e in (await admin(router))["engines"]}
        if all(e["state"] == "admitted" and e["version"] == "0.33.0" for e in listed.values()):
            break
        assert time.monotonic() < end, listed
        await asyncio.sleep(0.05)
    assert sorted(listed) == sorted(e["name"] for e in engines)
    assert "preflight: ok" in router.log_text()  # on_start as shipped: every engine and pair passed
    reply = await send(router.url, "/v1/completions", {**completion(unique_prompt(), max_tokens=3), "model": MODEL})
    assert reply.status == 200, reply.raw
    assert sum(fleet.stats(e["name"])["requests"]["decode"] for e in engines) >= 1
