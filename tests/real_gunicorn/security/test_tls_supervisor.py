"""``https://`` engines behind a private CA through the supervisor (docs/behaviour.md "The request path", "Recovery").

The CA applies on every connection to an engine, not only on the request legs: preflight,
the workers' model discovery, the supervisor's health checks, lifecycle validation and
probes. Before, the supervisor's session ignored ``engine.ca_file`` and an https fleet was
ejected by its own health checks a second after the start.

Two fake fleets, each serving one CA's certificates: ``hp0``/``hd0`` signed by CA ``a`` (the
one ``engine.ca_file`` names) and ``hx0`` signed by CA ``b``. Waits are on what the engines
saw (their count of ``/health`` and ``/version`` reads) or on the admin API, never on a
bare sleep. Models are not configured, so requests only succeed if discovery read
``/v1/models`` over TLS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal.testing.asking import http_get
from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from tests.real_gunicorn.support import (
    MODEL,
    TOKEN,
    admin,
    completion,
    engine_entry,
    records,
    send,
    start_router,
    unique_prompt,
    wait_state,
    wait_until,
)
from tests.tls_certs import HAVE_OPENSSL, good_and_rogue

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="needs the openssl command")

TRUSTED = ["hp0", "hd0"]
ROGUE = "hx0"
ROOT = Path(__file__).resolve().parents[3]
CONTRACT = {"model": MODEL, "engine_version": ">=0.33,<0.34", "kv_connector": "NixlConnector"}
RECOVERY = {"eject_after": 2, "health_interval_s": 0.3, "readmit_interval_s": 0.5, "readmit_interval_max_s": 1}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return good_and_rogue(tmp_path_factory.mktemp("pki"))


def _fleet(names: list[str], cert: Path, key: Path) -> FakeFleet:
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    return FakeFleet.start(names, args=["--model", MODEL, "--block-size", "4", *tls])


@pytest.fixture(scope="module")
def trusted(pki: dict[str, Path]) -> Iterator[FakeFleet]:
    fleet = _fleet(TRUSTED, pki["good"], pki["good_key"])
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def rogue(pki: dict[str, Path]) -> Iterator[FakeFleet]:
    fleet = _fleet([ROGUE], pki["rogue"], pki["rogue_key"])
    yield fleet
    fleet.stop()


def _engines() -> list[dict[str, Any]]:
    return [{"name": "hp0", "role": "producer"}, {"name": "hd0", "role": "consumer"}]


@pytest.fixture(scope="module")
def tls_router(
    trusted: FakeFleet, pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    """A contract, preflight at start, short health checks: nothing in it may eject hp0/hd0."""
    proc = start_router(
        trusted, _engines(), tmp_path_factory.mktemp("tls-sup"),
        server={"workers": 2, "admin_token": TOKEN},
        engine={"ca_file": str(pki["ca_a"])},
        preflight={"on_start": True},
        recovery=RECOVERY,
        engine_contract=CONTRACT,
    )
    yield proc
    proc.stop()
    wait_until(lambda: trusted.stats("hp0")["held_blocks"] == 0, 10, "hp0 holds no KV blocks")


@pytest.fixture(autouse=True)
def clean_faults(trusted: FakeFleet) -> Iterator[None]:
    yield
    for name in TRUSTED:
        trusted.control_request("DELETE", f"/engines/{name}/faults")


def _reads(fleet: FakeFleet, name: str, path: str) -> int:
    count: int = fleet.stats(name)["control_reads"][path]
    return count


def _probes(router: RouterProcess, engine: str, result: str) -> float:
    text = http_get(router.url + "/metrics")[1].decode()
    found = re.search(rf'^narwhal_probes_total{{engine="{engine}",result="{result}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def _one_completion(router: RouterProcess) -> None:
    reply = await send(router.url, "/v1/completions", completion(unique_prompt(), max_tokens=4))
    assert reply.status == 200, reply.raw
    assert reply.text == " t0 t1 t2 t3"


async def test_https_engines_stay_admitted_through_health_checks(
    tls_router: RouterProcess, trusted: FakeFleet
) -> None:
    before = {n: _reads(trusted, n, "health") for n in TRUSTED}
    # Six health intervals with eject_after = 2: three ejections' worth if the checks failed.
    wait_until(lambda: all(_reads(trusted, n, "health") >= before[n] + 6 for n in TRUSTED), 20,
               "six more health checks answered by each engine over TLS")
    for name in TRUSTED:
        entry = await engine_entry(tls_router, name)
        assert (entry["state"], entry["failure_streak"], entry["ejections"]) == ("admitted", 0, 0), entry
        assert entry["last_failure"] is None  # preflight passed too: it would say "preflight"
        assert entry["models"] == [MODEL]  # discovered from /v1/models over TLS
    await _one_completion(tls_router)


async def test_an_ejected_https_engine_comes_back_through_lifecycle_validation_and_a_probe(
    tls_router: RouterProcess, trusted: FakeFleet
) -> None:
    trusted.control_request("PUT", "/engines/hd0/faults", {"health_status": 503})
    entry = await wait_state(tls_router, "hd0", "ejected")
    assert entry["last_failure"]["reason"] == "health_check" and entry["ejections"] == 1
    # Healthy again but on a version outside the pin: lifecycle validation reads /version over
    # TLS and keeps it out. Two reads: the first probe that read it has finished.
    versions = _reads(trusted, "hd0", "version")
    trusted.control_request("PUT", "/engines/hd0/faults", {"version": "0.10.0"})
    wait_until(lambda: _reads(trusted, "hd0", "version") >= versions + 2, 15, "hd0's /version read twice")
    assert (await engine_entry(tls_router, "hd0"))["state"] in ("ejected", "probing")
    assert _probes(tls_router, "hd0", "pass") == 0.0
    trusted.control_request("DELETE", "/engines/hd0/faults")
    entry = await wait_state(tls_router, "hd0", "admitted", timeout=15)
    assert (entry["failure_streak"], entry["ejections"]) == (0, 1)
    assert _probes(tls_router, "hd0", "pass") == 1.0 and _probes(tls_router, "hd0", "fail") >= 2.0
    # The probe was a real stream over TLS: a handoff prefilled on hp0, decoded on hd0.
    decoded = records(trusted, "hd0", "narwhal probe")
    assert decoded and decoded[-1]["body"]["stream"] is True and decoded[-1]["outcome"] == "completed"
    assert records(trusted, "hp0", "narwhal probe")
    await _one_completion(tls_router)


@pytest.fixture(scope="module")
def rogue_router(
    trusted: FakeFleet, rogue: FakeFleet, pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    """hx0's certificate is CA b's. No preflight here: it would keep hx0 out from the start
    (``test_preflight_refuses_*``), and this router is about what health checks do."""
    engines = _engines() + [{"name": ROGUE, "role": "consumer", "url": rogue.engines[ROGUE]}]
    proc = start_router(
        trusted, engines, tmp_path_factory.mktemp("tls-rogue"),
        server={"workers": 1, "admin_token": TOKEN},
        engine={"ca_file": str(pki["ca_a"])},
        recovery=RECOVERY,
        engine_contract=CONTRACT,
    )
    yield proc
    proc.stop()


async def test_an_engine_whose_certificate_the_ca_did_not_sign_is_ejected_by_health_checks(
    rogue_router: RouterProcess, trusted: FakeFleet, rogue: FakeFleet
) -> None:
    entry = await wait_state(rogue_router, ROGUE, "ejected", timeout=10)
    assert entry["last_failure"]["reason"] == "health_check" and entry["ejections"] == 1
    # Refused at the handshake: not one HTTP request reached it, probes included.
    assert rogue.stats(ROGUE)["control_reads"] == {"health": 0, "version": 0, "models": 0, "metrics": 0}
    assert rogue.stats(ROGUE)["requests"]["total"] == 0
    body = await admin(rogue_router)
    assert {e["name"]: e["state"] for e in body["engines"]} == {"hp0": "admitted", "hd0": "admitted", ROGUE: "ejected"}
    await _one_completion(rogue_router)


def test_preflight_refuses_an_engine_whose_certificate_the_ca_did_not_sign(
    trusted: FakeFleet, rogue: FakeFleet, pki: dict[str, Path], tmp_path: Path
) -> None:
    rows = [{"name": n, "url": trusted.engines[n], "role": r} for n, r in (("hp0", "producer"), ("hd0", "consumer"))]
    rows.append({"name": ROGUE, "url": rogue.engines[ROGUE], "role": "consumer"})
    conf = {"engine": {"ca_file": str(pki["ca_a"]), "first_token_timeout_s": 3}, "engine_contract": CONTRACT}
    config = tmp_path / "narwhal.toml"
    shutil.move(write_config(rows, conf), config)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    cmd = [sys.executable, "-m", "narwhal", "preflight", "--config", str(config), "--json"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    verdicts = {e["name"]: (e["verdict"], e["reason"]) for e in doc["engines"]}
    assert verdicts == {"hp0": ("ok", ""), "hd0": ("ok", ""), ROGUE: ("fail", "unreachable")}
    pairs = {(p["producer"], p["consumer"]): (p["verdict"], p["reason"]) for p in doc["pairs"]}
    assert pairs == {("hp0", "hd0"): ("ok", ""), ("hp0", ROGUE): ("skip", f"consumer {ROGUE} failed")}
