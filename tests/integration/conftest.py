"""Real processes for the integration tests: one fake fleet, routers under real gunicorn.

One fake-fleet process serves every engine of the session; each router fixture is a real
gunicorn master with 2 aiohttp workers on an inherited 127.0.0.1 socket. Faults are injected
per request (``narwhal_fake`` in the body, which the router forwards like any unknown field)
or per engine through the fleet's control API. Every test writes a unique prompt so it can
find exactly the engine requests it caused.

At the end of each module every producer must hold zero KV blocks: a handoff the router
produced and neither decoded nor released would show up here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.harness import FakeFleet, RouterProcess, write_config

MODEL = "fake-model"
# Long enough that a leaked handoff is still held when a module ends: leaks must show up.
LEASE_S = 120
ENGINES = ["p0", "p1", "d0", "d1", "b0", "p2", "d2", "sp0", "sp1", "sd0", "sd1"]

TIMEOUTS = {
    "prefill_timeout_s": 2.5,
    "first_token_timeout_s": 2.5,
    "decode_read_timeout_s": 1.5,
}


@pytest.fixture(scope="session")
def fleet() -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(ENGINES, args=["--model", MODEL, "--lease-s", str(LEASE_S), "--block-size", "4"])
    yield fleet
    fleet.stop()


def start_router(
    fleet: FakeFleet, engines: list[dict[str, Any]], tmp: Any, gunicorn_args: tuple[str, ...] = (),
    **sections: dict[str, Any],
) -> RouterProcess:
    for engine in engines:
        if "url" not in engine:  # an engine of another fleet comes with its own
            engine["url"] = fleet.engines[engine["name"]]
    conf = {
        "server": {"workers": 2},
        "engine": dict(TIMEOUTS),
        "preflight": {"on_start": False},
        "log": {"access_log": str(tmp / "access.log"), "level": "warning"},
        # Fault tests inject many failures: breakers stay out of their way unless a test
        # (test_supervisor) is about breakers.
        "recovery": {"eject_after": 1000},
    }
    for key, values in sections.items():
        conf.setdefault(key, {}).update(values)
    return RouterProcess.start(
        write_config(engines, conf), log_path=str(tmp / "router.log"), gunicorn_args=gunicorn_args,
        workers=int(conf["server"].get("workers", 2)),
    )


@pytest.fixture(scope="module")
def router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """p0, p1 → d0, d1: crossed decodes only."""
    engines = [
        {"name": "p0", "role": "producer"},
        {"name": "p1", "role": "producer"},
        {"name": "d0", "role": "consumer"},
        {"name": "d1", "role": "consumer"},
    ]
    proc = start_router(fleet, engines, tmp_path_factory.mktemp("router"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def same_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """b0 alone, role both: every decode is a same-worker decode."""
    proc = start_router(fleet, [{"name": "b0", "role": "both"}], tmp_path_factory.mktemp("same"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def solo_router(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """p2 → d2 only, no silence bound, a short handoff age: deterministic placement."""
    engines = [{"name": "p2", "role": "producer"}, {"name": "d2", "role": "consumer"}]
    proc = start_router(
        fleet,
        engines,
        tmp_path_factory.mktemp("solo"),
        engine={"decode_read_timeout_s": 0},
        handoff={"max_age_s": 0.6},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module", autouse=True)
def no_stranded_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "fleet" not in request.fixturenames:
        return
    fleet: FakeFleet = request.getfixturevalue("fleet")
    wait_until(lambda: all(fleet.stats(n)["held_blocks"] == 0 for n in ENGINES), 10, "held KV blocks back to 0")


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for: {what}")


def settled(read: Any, expected: Any, timeout: float = 5.0) -> Any:
    """``read()`` once it returns ``expected`` (bounded), else its last value, for the caller's
    assert to show. For figures a worker updates just *after* the client has its response."""
    end = time.monotonic() + timeout
    value = read()
    while value != expected and time.monotonic() < end:
        time.sleep(0.05)
        value = read()
    return value


def unique_prompt(words: int = 12) -> str:
    tag = uuid.uuid4().hex
    return " ".join([tag] + [f"w{i}" for i in range(words - 1)])


def records(fleet: FakeFleet, engine: str, prompt: str) -> list[dict[str, Any]]:
    tag = prompt.split()[0]
    return fleet.control_request("GET", f"/engines/{engine}/requests?contains={tag}")["requests"]


def records_anywhere(fleet: FakeFleet, prompt: str, engines: list[str]) -> dict[str, list[dict[str, Any]]]:
    return {name: recs for name in engines if (recs := records(fleet, name, prompt))}

