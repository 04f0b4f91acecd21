"""Shared by the security tests: the pair, the secrets, the routers' error checks and the log check.

Each test module keeps its own list of the prompts it sent (``Prompts``) and ends with
``assert_nothing_secret_logged``: the logs of its routers, after all its failures, hold no secret
and none of its prompts.
"""
from __future__ import annotations

import base64
import uuid
from typing import Any

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.support import (
    Reply,
    access_log_of,
    error_of,
    records,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENGINE_SECRET = "engine-secret-" + uuid.uuid4().hex
AUTH_ENGINE_KEY = "engine-key-" + uuid.uuid4().hex
ADMIN_TOKEN = "s3cret"
CLIENT_KEY = "client-key-" + uuid.uuid4().hex
MAX_BODY = 65536
PAIR = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]


def refused_credentials(secret: str, other: str) -> list[Any]:
    """Every ``Authorization`` value that must not pass where ``secret`` is asked for, as pytest
    params named by what is wrong: none, empty, a bare or other scheme, a wrong, longer or shorter
    secret, Basic (plain and base64), no scheme, and ``other`` (the router's other secret)."""
    basic = base64.b64encode(f"{secret}:{secret}".encode()).decode()
    return [pytest.param(value, id=name) for name, value in (
        ("missing", None), ("empty", ""), ("bearer_no_value", "Bearer"), ("bearer_space", "Bearer "),
        ("wrong", "Bearer wrong"), ("longer", f"Bearer {secret}x"), ("prefix", f"Bearer {secret[:-1]}"),
        ("basic_b64", f"Basic {basic}"), ("basic", f"Basic {secret}"), ("no_scheme", secret),
        ("other_scheme", f"Token {secret}"), ("other_secret", f"Bearer {other}"),
    )]


def assert_router_error(reply: Reply, status: int, reason: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.raw[:500])
    err = error_of(reply)
    assert err["type"] == reason and err["code"] == status and err["param"] is None, err
    assert reply.headers.get("x-narwhal-error") == reason, dict(reply.headers)
    return err


def all_records(fleet: FakeFleet, prompt: str) -> list[dict[str, Any]]:
    return records(fleet, "p2", prompt) + records(fleet, "d2", prompt)


class Prompts(list[str]):
    """The prompts a module sent through its routers: none may show up in their logs."""

    def __call__(self, prompt: str) -> str:
        self.append(prompt)
        return prompt


def _log_texts(router: RouterProcess) -> str:
    texts = []
    for path in (router.log_path, access_log_of(router)):
        with open(path, "rb") as f:
            texts.append(f.read().decode("utf-8", "replace"))
    return "\n".join(texts)



def assert_nothing_secret_logged(open_router: RouterProcess, auth_router: RouterProcess, sent: Prompts,
                                 at_least: int) -> None:
    """Neither router's logs hold an engine key, a client key, the admin token or a prompt of ``sent``."""
    assert len(sent) >= at_least, len(sent)  # the module's traffic ran, failures included
    text = _log_texts(open_router)
    assert text.strip(), "no log output at all: the check below would be vacuous"
    assert ENGINE_SECRET not in text
    leaked = [p.split()[0] for p in sent if p.split()[0] in text]
    assert leaked == [], f"{len(leaked)} prompts found in the router's logs"
    text = _log_texts(auth_router)
    for secret in (AUTH_ENGINE_KEY, CLIENT_KEY, ADMIN_TOKEN):
        assert secret not in text, secret
