"""``https://`` engines (docs/behaviour.md "The request path"): the router trusts ``engine.ca_file``, and refuses an
untrusted one.

A private CA and a server certificate for 127.0.0.1 are made with the openssl command line;
a fake fleet serves them, and a router under gunicorn streams through it. A router without
the CA must not talk to the engine at all: 502 ``engine_unreachable``, the engine named.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import MODEL, completion, send, start_router, unique_prompt
from tests.tls_certs import HAVE_OPENSSL, make_ca, make_server_cert

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="needs the openssl command")

NAMES = ["tp0", "td0"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    make_server_cert(d, make_ca(d, "ca"), "server")
    return d


@pytest.fixture(scope="module")
def tls_fleet(certs: Path) -> Iterator[FakeFleet]:
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    fleet = FakeFleet.start(NAMES, args=["--model", MODEL, "--block-size", "4", *tls])
    yield fleet
    fleet.stop()


def _engines() -> list[dict[str, object]]:
    return [
        {"name": "tp0", "role": "producer", "models": [MODEL]},
        {"name": "td0", "role": "consumer", "models": [MODEL]},
    ]


@pytest.fixture(scope="module")
def trusting(tls_fleet: FakeFleet, certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("tls-ok")
    proc = start_router(tls_fleet, _engines(), tmp, engine={"ca_file": str(certs / "ca.pem")})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def untrusting(tls_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    # Never ready: its engines are unreachable to it (docs/behaviour.md "Recovery": /ready).
    proc = start_router(tls_fleet, _engines(), tmp_path_factory.mktemp("tls-no"), wait_ready=False)
    yield proc
    proc.stop()


def test_fleet_serves_https(tls_fleet: FakeFleet) -> None:
    assert all(url.startswith("https://127.0.0.1:") for url in tls_fleet.engines.values())


async def test_stream_through_https_engines_with_the_configured_ca(
    trusting: RouterProcess, tls_fleet: FakeFleet
) -> None:
    reply = await send(trusting.url, "/v1/completions", completion(unique_prompt(), max_tokens=4))
    assert reply.status == 200
    assert reply.text == " t0 t1 t2 t3"
    assert reply.events[-1] == b"[DONE]"
    assert tls_fleet.stats("tp0")["held_blocks"] == 0


async def test_an_engine_certificate_nobody_trusts_is_unreachable(untrusting: RouterProcess) -> None:
    reply = await send(untrusting.url, "/v1/completions", completion(unique_prompt(), max_tokens=4))
    assert reply.status == 502
    assert reply.headers["x-narwhal-error"] == "engine_unreachable"
    assert reply.json["error"]["message"] == "engine tp0 is unreachable (prefill)"
