"""The app's error shaping in-process (``worker.guard.Guard``: each route's wrapper and the resource
that takes what no route does, not a middleware): every refusal in the endpoint's
error shape (docs/behaviour.md "The other P/D endpoints": OpenAI's, Anthropic's on ``/v1/messages``) with
``x-narwhal-error`` and
an ``x-request-id``; aiohttp's own refusals (404, 405, 413) as the router's reasons; an
unhandled exception a 500 ``internal_error`` that says nothing of the traceback; the header
limit a 431. The same behaviours through real gunicorn are in tests/real_gunicorn/security/ and
tests/real_gunicorn/faults/; here each is pinned against the guard alone."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from narwhal.errors import RequestError
from narwhal.reasons import Reason
from narwhal.settings import Settings
from narwhal.worker.app import build_app
from narwhal.worker.guard import Guard

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]
HEADER_LIMIT = 2048
BODY_LIMIT = 1024


async def _refuse(request: web.Request) -> web.Response:
    raise RequestError("model is required", reason=Reason.BAD_REQUEST)


async def _crash(request: web.Request) -> web.Response:
    raise KeyError("secret-internal-detail")


async def _read_body(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="read")


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="fine")


async def _redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/elsewhere")


@pytest.fixture
async def client(aiohttp_client: ClientFactory) -> TestClient[Any, Any]:
    app = web.Application(client_max_size=BODY_LIMIT)
    guard = Guard(HEADER_LIMIT)
    for path, handler in (("/v1/completions", _refuse), ("/v1/messages", _refuse), ("/v1/chat/completions", _crash),
                          ("/v1/responses", _read_body), ("/tokenize", _ok)):
        app.router.add_post(path, guard.wrap(handler))
    app.router.add_get("/moved", guard.wrap(_redirect))
    guard.refuse_unrouted(app)
    return await aiohttp_client(app)


def _openai(status: int, reason: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": reason, "param": None, "code": status}}


async def test_a_router_refusal_is_in_openai_shape_with_its_reason_and_the_clients_request_id(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.post("/v1/completions", json={}, headers={"x-request-id": "client-id-1"})
    assert resp.status == 400
    assert await resp.json() == _openai(400, "bad_request", "model is required")
    assert resp.headers["x-narwhal-error"] == "bad_request"
    assert resp.headers["x-request-id"] == "client-id-1"


async def test_on_messages_the_refusal_is_in_anthropics_shape(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/messages", json={})
    assert resp.status == 400
    assert await resp.json() == {"type": "error",
                                 "error": {"type": "invalid_request_error", "message": "model is required"}}
    assert resp.headers["x-narwhal-error"] == "bad_request"
    assert resp.headers["x-request-id"]  # one made up: the client sent none


@pytest.mark.parametrize(("method", "path", "status", "reason", "message"), [
    ("POST", "/v1/nowhere", 404, "not_found", "not found"),
    ("GET", "/v1/completions", 405, "method_not_allowed", "Method Not Allowed"),
])
async def test_aiohttps_own_refusals_become_the_routers_reasons(
    client: TestClient[Any, Any], method: str, path: str, status: int, reason: str, message: str
) -> None:
    resp = await client.request(method, path)
    assert resp.status == status
    assert await resp.json() == _openai(status, reason, message)
    assert resp.headers["x-narwhal-error"] == reason


async def test_a_body_over_the_limit_is_a_413_in_shape(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/responses", data=b"x" * (BODY_LIMIT + 1))
    assert resp.status == 413
    body = await resp.json()
    assert body["error"]["type"] == "payload_too_large" and body["error"]["code"] == 413
    assert resp.headers["x-narwhal-error"] == "payload_too_large"


async def test_an_unhandled_exception_is_a_500_that_leaks_nothing_and_is_logged(
    client: TestClient[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        resp = await client.post("/v1/chat/completions", json={})
    assert resp.status == 500
    text = await resp.text()
    assert "secret-internal-detail" not in text and "Traceback" not in text
    assert await resp.json() == _openai(500, "internal_error", "internal error")
    assert resp.headers["x-narwhal-error"] == "internal_error"
    assert any("unhandled error on POST /v1/chat/completions" in r.getMessage() for r in caplog.records)


async def test_headers_over_the_limit_are_a_431(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/tokenize", headers={"x-padding": "a" * HEADER_LIMIT})
    assert resp.status == 431
    body = await resp.json()
    assert body["error"]["type"] == "header_too_large" and body["error"]["code"] == 431
    ok = await client.post("/tokenize", headers={"x-padding": "a" * (HEADER_LIMIT // 4)})
    assert ok.status == 200 and await ok.text() == "fine"


async def test_a_success_carries_a_request_id_and_an_invalid_client_id_is_replaced(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.post("/tokenize", headers={"x-request-id": "kept-id"})
    assert resp.status == 200 and resp.headers["x-request-id"] == "kept-id"
    resp = await client.post("/tokenize", headers={"x-request-id": "bad\u00e9id".encode().decode("latin-1")})
    assert resp.status == 200
    assert resp.headers["x-request-id"] not in ("", "bad\u00e9id") and resp.headers["x-request-id"].isascii()


async def test_a_redirect_is_not_an_error(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/moved", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/elsewhere"
    assert "x-narwhal-error" not in resp.headers


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/messages/more", 404),  # under a route's path, not its path: OpenAI's shape
    ("DELETE", "/moved", 405),
    ("HEAD", "/v1/completions", 405),
    ("OPTIONS", "/", 404),
])
async def test_what_no_route_takes_is_refused_in_openai_shape(
    client: TestClient[Any, Any], method: str, path: str, status: int
) -> None:
    resp = await client.request(method, path)
    assert resp.status == status
    reason = {404: "not_found", 405: "method_not_allowed"}[status]
    assert resp.headers["x-narwhal-error"] == reason and resp.headers["x-request-id"]
    if method != "HEAD":
        assert await resp.json() == _openai(status, reason, {404: "not found", 405: "Method Not Allowed"}[status])


async def test_headers_over_the_limit_are_a_431_on_a_path_no_route_takes(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/nowhere", headers={"x-padding": "a" * HEADER_LIMIT})
    assert resp.status == 431
    assert resp.headers["x-narwhal-error"] == "header_too_large"


def test_the_workers_app_runs_no_middleware() -> None:
    """aiohttp's middleware machinery (its own frame beside each middleware's) stays off every
    request: the routes shape their own errors."""
    app = build_app(Settings())
    assert tuple(app.middlewares) == ()
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    assert ("POST", "/v1/completions") in routes
    assert list(app.router.resources())[-1].canonical == "/{unrouted}"  # the catch-all, registered last
