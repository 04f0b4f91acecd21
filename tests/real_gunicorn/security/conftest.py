"""The security tests' two routers over p2 → d2, one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.testing.harness import FakeFleet, RouterProcess
from tests.real_gunicorn.security_support import ADMIN_TOKEN, AUTH_ENGINE_KEY, CLIENT_KEY, ENGINE_SECRET, MAX_BODY, PAIR
from tests.real_gunicorn.support import start_router


@pytest.fixture(scope="module")
def open_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """No admin token, no client keys; a secret engine key; debug logs; short engine timeouts."""
    tmp = tmp_path_factory.mktemp("security_open")
    proc = start_router(
        fleet,
        [dict(e) for e in PAIR],
        tmp,
        server={"max_body_bytes": MAX_BODY},
        engine={
            "api_key": ENGINE_SECRET,
            "prefill_timeout_s": 1,
            "first_token_timeout_s": 1,
            "decode_read_timeout_s": 0.5,
        },
        log={"level": "debug", "access_log": str(tmp / "access.log")},
    )
    proc.access_log_path = str(tmp / "access.log")  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def auth_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """Admin token and client keys configured."""
    tmp = tmp_path_factory.mktemp("security_auth")
    proc = start_router(
        fleet,
        [dict(e) for e in PAIR],
        tmp,
        server={"admin_token": ADMIN_TOKEN, "api_keys": ["other-key", CLIENT_KEY]},
        engine={"api_key": AUTH_ENGINE_KEY},
        log={"level": "debug", "access_log": str(tmp / "access.log")},
    )
    proc.access_log_path = str(tmp / "access.log")  # type: ignore[attr-defined]
    yield proc
    proc.stop()
