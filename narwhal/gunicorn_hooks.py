"""What the gunicorn master does for Narwhal: settings, the metrics directory, process events.

Prometheus multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` in the environment before
any process imports ``prometheus_client``; the master sets it here, before forking, and
every worker inherits it. A directory the master created itself is wiped at start and
removed at exit; one the operator set is only wiped of stale files at the first start
(never on a ``SIGHUP`` reload, which would lose the samples of workers still running).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

# Nothing here may import prometheus_client (or narwhal.metrics, narwhal.app) at module level:
# it must first be imported after PROMETHEUS_MULTIPROC_DIR is set.
from narwhal.settings import Settings, SettingsError, current, load_settings, load_settings_or_exit, remember

_PROM_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Not NARWHAL_-prefixed: every NARWHAL_ variable must be a setting.
_OWNED_ENV = "_NARWHAL_METRICS_DIR_OWNER"


def _prepare_metrics_dir() -> None:
    if os.environ.get(_OWNED_ENV):
        return  # a reload: the directory is already in use by live workers
    path = os.environ.get(_PROM_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.unlink(os.path.join(path, name))
        os.environ[_OWNED_ENV] = "external"
    else:
        os.environ[_PROM_ENV] = tempfile.mkdtemp(prefix="narwhal-metrics-")
        os.environ[_OWNED_ENV] = "owned"


def _bind(settings: Settings) -> list[str]:
    return [settings.server.bind]


def _load() -> Settings:
    running = current()
    if running is None:
        return load_settings_or_exit()
    # A SIGHUP reload: a broken file must not take down a running router.
    try:
        return load_settings()
    except SettingsError as exc:
        print(f"narwhal: reload refused, keeping the running settings: {exc}", file=sys.stderr, flush=True)
        return running


def gunicorn_settings() -> dict[str, Any]:
    settings = _load()
    remember(settings)
    _prepare_metrics_dir()
    return {
        "wsgi_app": "narwhal.app:create_app",
        "worker_class": "aiohttp.GunicornUVLoopWebWorker",
        "bind": _bind(settings),
        "workers": settings.server.workers,
        # gunicorn takes whole seconds; the aiohttp runner uses the exact values.
        "graceful_timeout": math.ceil(settings.server.graceful_timeout_s),
        "keepalive": math.ceil(settings.server.keepalive_s),
        # The aiohttp worker heartbeats every second whatever the requests do: this only
        # catches a worker whose event loop is wedged.
        "timeout": 30,
        "proc_name": "narwhal",
        # gunicorn 27's control socket lives at one path per user: two routers on a host would
        # fight over it, and Narwhal needs none of its commands.
        "control_socket_disable": True,
        "errorlog": "-",
        "accesslog": None,
        "loglevel": settings.log.level,
        "limit_request_field_size": settings.server.max_header_bytes,
    }


_WATCHDOG: dict[str, int] = {}

# gunicorn re-executes a config given as a *file* on SIGHUP (one given as python:module is
# imported once and never re-read), so Narwhal always passes the file.
CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gunicorn_conf.py")


def on_starting(server: Any) -> None:
    """In the master, before the listening sockets exist: shared memory, then the supervisor."""
    from narwhal import shm
    from narwhal.settings import current_or_load
    from narwhal.shm.shared import SharedFleet
    from narwhal.supervisor.process import start_watchdog

    settings = current_or_load()
    # Room for a reload: old and new workers side by side, engines added up to max_engines.
    shm.SHARED = SharedFleet.create(engines=settings.server.max_engines, slots=max(2 * settings.server.workers, 8))
    if settings.preflight.on_start and settings.engines:
        from narwhal.supervisor.startup import preflight_on_start

        # Before any worker exists, so an engine that fails starts ejected everywhere.
        preflight_on_start(shm.SHARED, settings)
    _WATCHDOG["pid"] = start_watchdog(shm.SHARED)


def on_reload(server: Any) -> None:
    """SIGHUP: the supervisor restarts on the reloaded settings (new workers read them too)."""
    pid = _WATCHDOG.get("pid")
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)


def post_worker_init(worker: Any) -> None:
    """In each worker: take over the listening sockets (``narwhal.accept``), and note when
    SIGTERM arrives, so in-flight streams are ended before the master's graceful timeout
    (counted from the signal) rather than aiohttp's (counted from when the worker gets round
    to stopping, up to a second later)."""
    loop = getattr(worker, "loop", None)
    if loop is None:
        return
    from narwhal import accept, app

    if worker.wsgi is app.create_app and not worker.cfg.is_ssl:
        # Narwhal's app accepts from these itself (narwhal.accept): aiohttp's worker starts
        # no server of its own on them. TLS listeners, and any other app run with this
        # configuration, stay with aiohttp.
        accept.LISTENERS[:] = worker.sockets
        worker.sockets = []

    def on_term() -> None:
        app.note_stop_requested(loop.time())
        worker.handle_exit(signal.SIGTERM, None)

    loop.add_signal_handler(signal.SIGTERM, on_term)


def child_exit(server: Any, worker: Any) -> None:
    from narwhal import shm

    if shm.SHARED is not None:
        # The worker is gone: give back whatever it held (its slot has no other writer now).
        for slot in range(shm.SHARED.layout.slots):
            if shm.SHARED.slot_pid(slot) == worker.pid:
                shm.SHARED.clear_slot(slot)
    if os.environ.get(_PROM_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    pid = _WATCHDOG.pop("pid", 0)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ChildProcessError):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0:
                time.sleep(0.02)
    path = os.environ.get(_PROM_ENV)
    if path and os.environ.get(_OWNED_ENV) == "owned":
        shutil.rmtree(path, ignore_errors=True)
