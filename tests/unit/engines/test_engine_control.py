"""``narwhal.engines.control``: the one place for engine TLS, the engine key and control reads.

TLS is checked with real handshakes against in-process fake engines serving certificates of
two private CAs, so "trusts the configured CA, and only it" is observed, not assumed.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.engines.control import (
    ControlClient,
    ControlError,
    PooledReader,
    VersionPin,
    auth_headers,
    auth_line,
    open_session,
    parse_models,
    parse_version,
    ssl_context,
)
from narwhal.engines.http1 import Origin, UpstreamPool
from narwhal.errors import EngineError
from narwhal.fake_engine import FakeEngine
from narwhal.settings import EngineSettings
from narwhal.settings.engines import EngineContract
from tests.tls_certs import HAVE_OPENSSL, good_and_rogue, server_context

needs_openssl = pytest.mark.skipif(not HAVE_OPENSSL, reason="needs the openssl command")


class Ref:
    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, url


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CA ``a`` signs ``good``; CA ``b`` signs ``rogue``."""
    return good_and_rogue(tmp_path_factory.mktemp("pki"))


async def _tls_engine(name: str, cert: Path, key: Path) -> FakeEngine:
    engine = FakeEngine(name, block_size=4, ssl_context=server_context(cert, key))
    await engine.start()
    return engine


@pytest.fixture
async def good(pki: dict[str, Path]) -> AsyncIterator[FakeEngine]:
    engine = await _tls_engine("good", pki["good"], pki["good_key"])
    yield engine
    await engine.close()


@pytest.fixture
async def rogue(pki: dict[str, Path]) -> AsyncIterator[FakeEngine]:
    engine = await _tls_engine("rogue", pki["rogue"], pki["rogue_key"])
    yield engine
    await engine.close()


def _ref(engine: FakeEngine) -> Ref:
    assert engine.url is not None and engine.url.startswith("https://")
    return Ref(engine.name, engine.url)


@pytest.fixture
async def trusting_a(pki: dict[str, Path]) -> AsyncIterator[ControlClient]:
    settings = EngineSettings(ca_file=str(pki["ca_a"]))
    async with open_session(settings) as session:
        yield ControlClient(session, settings, timeout_s=5)


# ---------------------------------------------------------------------- the TLS context


def test_without_a_ca_file_the_context_verifies_hosts_against_the_system_store() -> None:
    ctx = ssl_context("")
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname is True
    assert ctx.cert_store_stats() == ssl.create_default_context().cert_store_stats()


@needs_openssl
def test_with_a_ca_file_that_ca_alone_is_trusted(pki: dict[str, Path]) -> None:
    ctx = ssl_context(str(pki["ca_a"]))
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname is True
    subjects = [dict(item[0] for item in cert["subject"]) for cert in ctx.get_ca_certs()]
    assert subjects == [{"commonName": "narwhal test CA ca-a"}]


@needs_openssl
async def test_control_reads_reach_an_engine_the_configured_ca_signed(
    good: FakeEngine, trusting_a: ControlClient
) -> None:
    ref = _ref(good)
    assert await trusting_a.health(ref) is True
    assert await trusting_a.version(ref) == "0.33.0"
    assert await trusting_a.models(ref) == ["fake-model"]
    assert good.control_reads == {"health": 1, "version": 1, "models": 1, "metrics": 0}


@needs_openssl
async def test_a_certificate_another_ca_signed_is_refused(rogue: FakeEngine, trusting_a: ControlClient) -> None:
    ref = _ref(rogue)
    with pytest.raises(ControlError) as info:
        await trusting_a.get(ref, "/health")
    assert info.value.reason == "unreachable"
    assert await trusting_a.health(ref) is False
    assert await trusting_a.models(ref) is None
    assert rogue.control_reads == {"health": 0, "version": 0, "models": 0, "metrics": 0}  # none got through


@needs_openssl
async def test_without_the_ca_a_private_ca_engine_is_refused(good: FakeEngine) -> None:
    settings = EngineSettings()
    async with open_session(settings) as session:
        assert await ControlClient(session, settings, timeout_s=5).health(_ref(good)) is False
    assert good.control_reads["health"] == 0


@needs_openssl
async def test_the_data_plane_client_uses_the_same_context_and_key(
    pki: dict[str, Path], good: FakeEngine, rogue: FakeEngine
) -> None:
    client = EngineClient.for_settings(EngineSettings(ca_file=str(pki["ca_a"]), api_key="engine-key"))
    try:
        body = {"model": "fake-model", "prompt": "a b c d e f g h", "max_tokens": 2}
        result = await client.prefill(_ref(good), endpoints.COMPLETIONS, body, request_id="rid-tls")
        assert result.producer == "good"
        assert good.get_records()[-1]["headers"]["authorization"] == "Bearer engine-key"
        with pytest.raises(EngineError) as info:
            await client.prefill(_ref(rogue), endpoints.COMPLETIONS, body, request_id="rid-rogue")
        assert info.value.reason == "engine_unreachable"
        assert info.value.message == "engine rogue is unreachable (prefill)"
        assert rogue.get_records() == []
    finally:
        await client.close()


def test_an_https_origin_without_a_context_is_refused() -> None:
    # No silent fallback to the system store: that would bypass engine.ca_file.
    with pytest.raises(ValueError, match="needs a TLS context"):
        Origin("https://127.0.0.1:8443", None)
    assert Origin("http://127.0.0.1:8000", None).ssl is None
    assert UpstreamPool().origin("http://127.0.0.1:8000").ssl is None


# ---------------------------------------------------------------------- the engine key


def test_the_engine_key_header_and_its_raw_line() -> None:
    keyed = EngineSettings(api_key="s3cret")
    assert auth_headers(keyed) == {"Authorization": "Bearer s3cret"}
    assert auth_line(keyed) == b"Authorization: Bearer s3cret\r\n"
    assert auth_headers(EngineSettings()) == {}
    assert auth_line(EngineSettings()) == b""


async def _serve(handler: web.Handler) -> TestServer:
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    server = TestServer(app)
    await server.start_server()
    return server


def _ref_of(server: TestServer) -> Ref:
    """Engine e0 at the test server's URL."""
    return Ref("e0", str(server.make_url("")).rstrip("/"))


async def _hung(request: web.Request) -> web.Response:
    """An engine that answers nothing for 30 s: far past every bound under test."""
    await asyncio.sleep(30)
    return web.Response()


def _closed_port() -> int:
    """A local port nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_control_reads_send_the_engine_key_and_report_statuses() -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(status=503)

    server = await _serve(handler)
    settings = EngineSettings(api_key="k1")
    try:
        async with open_session(settings) as session:
            control = ControlClient(session, settings, timeout_s=5)
            ref = _ref_of(server)
            assert await control.get(ref, "/health") == (503, b"")
            assert await control.health(ref) is False  # vLLM's dead-engine answer
            assert await control.version(ref) is None
        assert seen == ["Bearer k1", "Bearer k1", "Bearer k1"]
    finally:
        await server.close()


async def test_a_hung_engine_costs_one_bounded_read() -> None:
    server = await _serve(_hung)
    settings = EngineSettings()
    try:
        async with open_session(settings) as session:
            control = ControlClient(session, settings, timeout_s=0.2)
            started = asyncio.get_running_loop().time()
            with pytest.raises(ControlError) as info:
                await control.get(_ref_of(server), "/health")
            assert info.value.reason == "timed out after 0.2s"
            assert asyncio.get_running_loop().time() - started < 5  # bounded, not 30 s
    finally:
        await server.close()


async def test_a_closed_port_is_unreachable() -> None:
    port = _closed_port()
    settings = EngineSettings()
    async with open_session(settings) as session:
        control = ControlClient(session, settings, timeout_s=5)
        with pytest.raises(ControlError) as info:
            await control.get(Ref("e0", f"http://127.0.0.1:{port}"), "/health")
    assert info.value.reason == "unreachable"


# ---------------------------------------------------------------------- the pooled reader (load reads)


@needs_openssl
async def test_the_pooled_reader_verifies_as_every_control_read_does(
    pki: dict[str, Path], good: FakeEngine, rogue: FakeEngine
) -> None:
    reader = PooledReader(EngineSettings(ca_file=str(pki["ca_a"])), timeout_s=5)
    try:
        status, body = await reader.get(_ref(good), "/metrics")
        assert status == 200 and b"vllm:num_requests_running" in body
        with pytest.raises(ControlError) as info:
            await reader.get(_ref(rogue), "/metrics")
        assert info.value.reason == "unreachable"
    finally:
        await reader.close()


async def test_the_pooled_reader_sends_the_key_reports_statuses_and_reuses_its_connection() -> None:
    seen: list[tuple[str | None, object]] = []

    async def handler(request: web.Request) -> web.Response:
        transport = request.transport
        seen.append((request.headers.get("Authorization"), transport.get_extra_info("peername") if transport else None))
        if request.path == "/down":
            return web.Response(status=503)
        return web.Response(body=b"vllm:num_requests_running 3\n")

    server = await _serve(handler)
    reader = PooledReader(EngineSettings(api_key="k1"), timeout_s=5)
    try:
        ref = _ref_of(server)
        assert await reader.get(ref, "/metrics") == (200, b"vllm:num_requests_running 3\n")
        assert await reader.get(ref, "/down") == (503, b"")
        assert await reader.get(ref, "/metrics") == (200, b"vllm:num_requests_running 3\n")
        assert [key for key, _ in seen] == ["Bearer k1"] * 3
        assert len({peer for _, peer in seen}) == 1  # one keep-alive connection for every read
    finally:
        await reader.close()
        await server.close()


async def test_the_pooled_reader_bounds_a_hung_engine_and_names_a_closed_port() -> None:
    server = await _serve(_hung)
    reader = PooledReader(EngineSettings(), timeout_s=0.2)
    port = _closed_port()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(ControlError) as info:
            await reader.get(_ref_of(server), "/metrics")
        assert info.value.reason == "timed out after 0.2s"
        assert asyncio.get_running_loop().time() - started < 5  # bounded, not 30 s
        with pytest.raises(ControlError) as info:
            await reader.get(Ref("e1", f"http://127.0.0.1:{port}"), "/metrics")
        assert info.value.reason == "unreachable"
        assert reader.pool.open_connections == 0  # the timed-out one was closed, not pooled
    finally:
        await reader.close()
        await server.close()


# ---------------------------------------------------------------------- reading answers


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}', ["m1", "m2"]),
        (b'{"data": []}', []),
        (b'{"data": [{"id": "m1"}, {"id": "m1"}]}', ["m1"]),
        (b'{"data": ["m1", 7, null, {"id": 3}, {"name": "x"}, {"id": "ok"}]}', ["ok"]),
        (b"", None),
        (b"not json", None),
        (b"<html>502 Bad Gateway</html>", None),
        (b"[]", None),
        (b'"data"', None),
        (b"{}", None),
        (b'{"data": {"id": "m1"}}', None),
        (b'{"data": "m1"}', None),
    ],
)
def test_parse_models(body: bytes, expected: list[str] | None) -> None:
    assert parse_models(body) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"version": "0.11.0"}', "0.11.0"),
        (b'{"version": 11}', None),
        (b'{"v": "0.11.0"}', None),
        (b'["0.11.0"]', None),
        (b"garbage", None),
    ],
)
def test_parse_version(body: bytes, expected: str | None) -> None:
    assert parse_version(body) == expected


# ---------------------------------------------------------------------- the version pin


def test_a_version_pin_matches_equal_pep440_versions() -> None:
    pin = VersionPin("0.11.0")
    assert [pin.matches(v) for v in ("0.11.0", "0.11", "v0.11.0", "0.11.1", "0.11.0rc1", "weird")] == [
        True, True, True, False, False, False,
    ]


ENGINE_VERSIONS = ("0.11.0", "0.11.0+cu126", "0.11.0+cu121.abc", "0.11", "0.11.1", "0.11.0rc1", "0.11.0.post1",
                   "0.11.0.dev3+g0123abc", "1!0.11.0", "not-a-version")


def test_a_bare_pin_means_pep440_equality_local_labels_included() -> None:
    # A pin of 0.11.0 refused the CUDA build 0.11.0+cu126 that ==0.11.0 met.
    # PEP 440: a version without a local label matches any local label of that version.
    for bare, spec in (("0.11.0", "==0.11.0"), ("0.11", "==0.11"), ("0.11.0+cu126", "==0.11.0+cu126")):
        assert [VersionPin(bare).matches(v) for v in ENGINE_VERSIONS] == [
            VersionPin(spec).matches(v) for v in ENGINE_VERSIONS
        ], bare
    assert VersionPin("0.11.0").matches("0.11.0+cu126") and VersionPin("0.11.0").matches("0.11.0+cu121.abc")
    # A pin naming a local label is met by that build alone.
    local = VersionPin("0.11.0+cu126")
    assert [local.matches(v) for v in ("0.11.0+cu126", "0.11.0", "0.11.0+cu121")] == [True, False, False]


def test_a_specifier_pin_admits_dev_builds_in_range() -> None:
    pin = VersionPin(" >=0.10,<0.12 ")
    assert pin.text == ">=0.10,<0.12"
    assert [pin.matches(v) for v in ("0.10.5", "0.11.1.dev3+g0123abc", "0.12.1", "0.9", "n/a")] == [
        True, True, False, False, False,
    ]


def test_no_contract_or_an_empty_pin_means_no_pin() -> None:
    assert VersionPin.of(None) is None
    assert VersionPin.of(EngineContract(model="m")) is None
    pin = VersionPin.of(EngineContract(engine_version="~=0.11.0"))
    assert pin is not None and pin.matches("0.11.4") and not pin.matches("0.12.0")


def test_a_pin_settings_refused_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="invalid PEP 440 version 'not a version!'"):
        VersionPin("not a version!")

