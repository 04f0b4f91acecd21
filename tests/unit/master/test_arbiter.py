"""What Narwhal changes in gunicorn's Arbiter (``master.arbiter``): the five methods it wraps are
gunicorn's, on this release; each wrapper calls gunicorn's own and adds its one thing. (The
behaviour each buys is shown through real gunicorn: the keeper's tests, the stop-signal tests in
test_worker_stop.py.)"""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

from gunicorn.arbiter import Arbiter

from narwhal.master import arbiter
from narwhal.stop_signals import STOP_SIGNALS


class Keeper:
    def __init__(self) -> None:
        self.checks = 0
        self.stopping = False

    def check(self) -> None:
        self.checks += 1


def master(calls: list[str]) -> Any:
    """A stand-in for the running Arbiter: each method records its call."""

    def record(name: str) -> Any:
        def method(*args: object) -> str:
            calls.append(name)
            return name
        return method

    return SimpleNamespace(**{name: record(name) for name in arbiter.WRAPPED})


def test_every_wrapped_method_is_gunicorns() -> None:
    for name in arbiter.WRAPPED:
        assert callable(getattr(Arbiter, name)), name


def test_each_wrapper_calls_gunicorns_method_and_adds_its_one_thing() -> None:
    calls: list[str] = []
    server, keeper = master(calls), Keeper()
    arbiter.adapt(server, keeper, lambda: None)  # type: ignore[arg-type]
    server.manage_workers()
    server.reap_workers()
    assert calls == ["manage_workers", "reap_workers"] and keeper.checks == 2
    assert not keeper.stopping
    server.stop(True)
    assert calls[-1] == "stop" and keeper.stopping  # told first: no supervisor forked on the way out


def test_a_fork_holds_the_stop_signals_and_the_master_takes_its_own_back() -> None:
    seen: list[set[signal.Signals]] = []
    server = master([])
    server.spawn_worker = lambda: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    arbiter.adapt(server, Keeper(), lambda: None)  # type: ignore[arg-type]
    server.spawn_worker()
    assert set(STOP_SIGNALS) <= seen[0]  # blocked while gunicorn forks
    assert not set(STOP_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # unblocked in the master after


def test_a_reload_the_settings_would_refuse_replaces_no_worker() -> None:
    calls: list[str] = []
    server = master(calls)
    refusal: list[str | None] = ["engines.0.url: expected an http:// or https:// URL"]
    arbiter.adapt(server, Keeper(), lambda: refusal[0])  # type: ignore[arg-type]
    server.reload()
    assert calls == []  # gunicorn's reload (new workers for old) never ran
    refusal[0] = None
    server.reload()
    assert calls == ["reload"]
