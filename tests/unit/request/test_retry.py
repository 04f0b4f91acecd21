"""The retry decision (docs/behaviour.md "Recovery"): a transient fault before visible output, within max_retries and
the deadline; 429 and in-stream 5xx by status; never once the client has output."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from narwhal.errors import EngineClientError, EngineError
from narwhal.request.router import Router
from narwhal.settings import Settings


def _router(max_retries: int) -> Router:
    router = Router.__new__(Router)  # the decision needs only the recovery settings
    router.recovery = Settings.model_validate({"recovery": {"max_retries": max_retries}}).recovery
    return router


def _case(attempts: int, *, committed: bool = False, deadline_in_s: float = 30) -> tuple[Any, int, Any]:
    req = SimpleNamespace(deadline=asyncio.get_running_loop().time() + deadline_in_s)
    return req, attempts, SimpleNamespace(committed=committed)


def _fault(reason: str = "engine_5xx", status: int | None = None) -> EngineError:
    return EngineError("x", reason=reason, engine="p0", phase="prefill", status=status)


async def test_a_transient_fault_is_retried_while_retries_and_the_deadline_allow() -> None:
    router = _router(max_retries=1)
    assert router._retryable(_fault(), *_case(1))  # type: ignore[arg-type]
    assert not router._retryable(_fault(), *_case(2))  # type: ignore[arg-type]
    assert not router._retryable(_fault(), *_case(1, deadline_in_s=-1))  # type: ignore[arg-type]
    assert not _router(max_retries=0)._retryable(_fault(), *_case(1))  # type: ignore[arg-type]


async def test_nothing_is_retried_once_the_client_has_output() -> None:
    assert not _router(3)._retryable(_fault("first_token_timeout"), *_case(1, committed=True))  # type: ignore[arg-type]


async def test_status_decides_for_engine_4xx_and_in_stream_errors() -> None:
    router = _router(1)
    overloaded = EngineClientError("busy", engine="d0", phase="decode", status=429)
    refused = EngineClientError("bad", engine="d0", phase="decode", status=400)
    assert router._retryable(overloaded, *_case(1))  # type: ignore[arg-type]
    assert not router._retryable(refused, *_case(1))  # type: ignore[arg-type]
    assert router._retryable(_fault("engine_stream_error", 503), *_case(1))  # type: ignore[arg-type]
    assert not router._retryable(_fault("engine_stream_error", 400), *_case(1))  # type: ignore[arg-type]
    assert not router._retryable(_fault("decode_silence"), *_case(1))  # type: ignore[arg-type]
