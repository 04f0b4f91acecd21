"""Who may reach what, on the real router (gunicorn, 2 workers) over p2 → d2: a client's
``kv_transfer_params`` never reach an engine; the admin API and its token; client API keys, never
forwarded to an engine. Last, the logs hold no secret and no prompt.
"""
from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.security_support import (
    ADMIN_TOKEN,
    AUTH_ENGINE_KEY,
    CHAT,
    CLIENT_KEY,
    COMPLETIONS,
    ENGINE_SECRET,
    Prompts,
    all_records,
    assert_nothing_secret_logged,
    assert_router_error,
    refused_credentials,
)
from tests.real_gunicorn.support import (
    MODEL,
    chat,
    completion,
    send,
    unique_prompt,
)

SENT = Prompts()


# -- client kv_transfer_params --------------------------------------------------------------

EVIL = {
    "do_remote_prefill": True,
    "do_remote_decode": True,
    "remote_engine_id": "evil-engine",
    "remote_host": "evil.example",
    "remote_port": 46_811,
    "remote_block_ids": [1, 2, 3],
}


def _raw_with_duplicates(body: dict[str, Any]) -> bytes:
    """The body with kv_transfer_params three times over (first, middle and last key)."""
    inner = orjson.dumps(body)[1:-1]
    evil = orjson.dumps(EVIL)
    return (
        b'{"kv_transfer_params":'
        + evil
        + b","
        + inner
        + b',"kv_transfer_params":'
        + evil
        + b',"kv_transfer_params":{"remote_host":"evil.example"}}'
    )


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("spelling", ["top_level", "duplicates", "null", "string", "list"])
async def test_client_kv_transfer_params_never_reach_an_engine(
    open_router: RouterProcess, fleet: FakeFleet, endpoint: str, stream: bool, spelling: str
) -> None:
    prompt = SENT(unique_prompt())
    body = (completion if endpoint == COMPLETIONS else chat)(prompt, stream=stream, max_tokens=3)
    raw = None
    if spelling == "top_level":
        body["kv_transfer_params"] = EVIL
    elif spelling == "duplicates":
        raw = _raw_with_duplicates(body)
    else:
        body["kv_transfer_params"] = {"null": None, "string": "evil.example", "list": [EVIL]}[spelling]
    reply = await send(open_router.url, endpoint, body if raw is None else None, raw=raw)
    assert reply.status == 200, reply.raw[:500]
    recs = all_records(fleet, prompt)
    prefills = [r for r in recs if r["phase"] == "prefill"]
    decodes = [r for r in recs if r["phase"] == "decode"]
    assert len(prefills) == 1 and len(decodes) == 1, recs
    for rec in recs:
        dumped = orjson.dumps(rec["body"])
        assert b"evil" not in dumped, rec["body"]
        kv = rec["body"].get("kv_transfer_params")
        assert kv is None or kv.get("remote_port") != 46_811, rec["body"]
    # What the engines did get is the router's own: P a fresh request, D P's descriptor.
    prefill_kv = prefills[0]["body"]["kv_transfer_params"]
    assert prefill_kv["do_remote_decode"] is True and prefill_kv.get("do_remote_prefill") is not True, prefill_kv
    assert all(v is None for k, v in prefill_kv.items() if k.startswith("remote_")), prefill_kv
    decode_kv = decodes[0]["body"]["kv_transfer_params"]
    assert decode_kv["remote_engine_id"] == fleet.stats("p2")["engine_id"]
    assert decode_kv["remote_host"] != "evil.example"


# -- admin routes ---------------------------------------------------------------------------

ADMIN_ROUTES = [("GET", "/admin/engines"), ("POST", "/admin/engines/p2/readmit")]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("auth", [None, f"Bearer {ADMIN_TOKEN}"], ids=["no_auth", "bearer"])
async def test_admin_api_is_404_without_an_admin_token(
    open_router: RouterProcess, method: str, path: str, auth: str | None
) -> None:
    headers = {"Authorization": auth} if auth else {}
    reply = await send(open_router.url, path, method=method, headers=headers)
    assert_router_error(reply, 404, "not_found")


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("auth", refused_credentials(ADMIN_TOKEN, CLIENT_KEY))
async def test_admin_api_refuses_a_missing_wrong_or_malformed_token(
    auth_router: RouterProcess, method: str, path: str, auth: str | None
) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    reply = await send(auth_router.url, path, method=method, headers=headers)
    assert_router_error(reply, 401, "unauthorized")
    assert ADMIN_TOKEN not in reply.raw.decode()


async def test_admin_api_answers_the_right_token(auth_router: RouterProcess, fleet: FakeFleet) -> None:
    reply = await send(
        auth_router.url, "/admin/engines", method="GET", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert reply.status == 200, reply.raw
    engines = {e["name"]: e for e in reply.json["engines"]}
    assert set(engines) == {"p2", "d2"}
    assert engines["p2"]["url"] == fleet.engines["p2"]  # the admin API is the one place URLs appear
    reply = await send(auth_router.url, "/admin/engines/p2/readmit", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status == 200, reply.raw
    assert reply.json["name"] == "p2" and reply.json["state"] == "admitted"


# -- client API keys ------------------------------------------------------------------------


@pytest.mark.parametrize("auth", refused_credentials(CLIENT_KEY, ADMIN_TOKEN))
@pytest.mark.parametrize(("method", "path"), [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models")])
async def test_client_keys_are_required_on_v1(
    auth_router: RouterProcess, fleet: FakeFleet, auth: str | None, method: str, path: str
) -> None:
    # docs/behaviour.md "The request path": with server.api_keys set, all of /v1/* requires `Authorization: Bearer
    # <key>`,
    # GET /v1/models included.
    prompt = unique_prompt()
    body = None
    if method == "POST":
        body = (completion if path == COMPLETIONS else chat)(prompt, max_tokens=2)
    headers = {"Authorization": auth} if auth is not None else {}
    reply = await send(auth_router.url, path, body, method=method, headers=headers)
    err = assert_router_error(reply, 401, "unauthorized")
    assert CLIENT_KEY not in err["message"]
    if method == "POST":
        assert all_records(fleet, prompt) == []  # refused before anything reached an engine


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
async def test_the_right_client_key_works_and_is_never_forwarded(
    auth_router: RouterProcess, fleet: FakeFleet, endpoint: str
) -> None:
    prompt = unique_prompt()
    body = (completion if endpoint == COMPLETIONS else chat)(prompt, max_tokens=2)
    reply = await send(auth_router.url, endpoint, body, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert reply.status == 200, reply.raw
    models = await send(auth_router.url, "/v1/models", method="GET", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert models.status == 200 and [m["id"] for m in models.json["data"]] == [MODEL]
    recs = all_records(fleet, prompt)
    assert {r["phase"] for r in recs} == {"prefill", "decode"}
    for rec in recs:
        assert rec["headers"].get("authorization") == f"Bearer {AUTH_ENGINE_KEY}", rec["headers"]


async def test_without_client_keys_the_client_authorization_is_not_forwarded(
    open_router: RouterProcess, fleet: FakeFleet
) -> None:
    prompt = SENT(unique_prompt())
    reply = await send(
        open_router.url, COMPLETIONS, completion(prompt, max_tokens=2), headers={"Authorization": "Bearer client-own"}
    )
    assert reply.status == 200, reply.raw
    recs = all_records(fleet, prompt)
    assert len(recs) == 2
    for rec in recs:
        assert rec["headers"].get("authorization") == f"Bearer {ENGINE_SECRET}", rec["headers"]


def test_access_sent_no_secret_and_no_prompt_to_the_logs(
    open_router: RouterProcess, auth_router: RouterProcess
) -> None:
    assert_nothing_secret_logged(open_router, auth_router, SENT, at_least=20)
