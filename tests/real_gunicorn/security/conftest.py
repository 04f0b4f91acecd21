"""The security tests' two routers over p2 → d2, one per test module."""

from __future__ import annotations

from tests.real_gunicorn.fixtures import router_fixture
from tests.real_gunicorn.security_support import ADMIN_TOKEN, AUTH_ENGINE_KEY, CLIENT_KEY, ENGINE_SECRET, MAX_BODY, PAIR

open_router = router_fixture(
    PAIR, "No admin token, no client keys; a secret engine key; debug logs; short engine timeouts.",
    server={"max_body_bytes": MAX_BODY},
    engine={"api_key": ENGINE_SECRET, "prefill_timeout_s": 1, "first_token_timeout_s": 1, "decode_read_timeout_s": 0.5},
    log={"level": "debug"},
)
auth_router = router_fixture(
    PAIR, "Admin token and client keys configured.",
    server={"admin_token": ADMIN_TOKEN, "api_keys": ["other-key", CLIENT_KEY]},
    engine={"api_key": AUTH_ENGINE_KEY},
    log={"level": "debug"},
)
