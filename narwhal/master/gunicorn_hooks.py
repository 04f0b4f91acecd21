"""What the gunicorn master does for Narwhal: settings, the metrics directory, process events.

Prometheus multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` in the environment before
any process imports ``prometheus_client``; the master sets it here, before forking, and
every worker inherits it. A directory the master created itself is wiped at start and
removed at exit; one the operator set is only wiped of stale files at the first start
(never on a ``SIGHUP`` reload, which would lose the samples of workers still running).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from typing import Any

from narwhal.master import arbiter
from narwhal.settings import (
    MAX_WORKERS,
    Settings,
    SettingsError,
    current,
    load_settings,
    load_settings_or_exit,
    remember,
)

# Nothing here may import prometheus_client (or narwhal.metrics, narwhal.worker.app) at module level:
# it must first be imported after PROMETHEUS_MULTIPROC_DIR is set.

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
            if name.endswith(".db") or name.startswith(".once-"):  # a run's metrics, and its once-marks (logs)
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
        settings = load_settings()
        _check_room(settings)
        _assign_engine_slots(settings)  # last: it writes the table, for the workers about to fork
    except SettingsError as exc:
        print(f"narwhal: reload refused, keeping the running settings: {exc}", file=sys.stderr, flush=True)
        return running
    from narwhal.settings.effective import changed_keys

    changed = changed_keys(running, settings)
    print(f"narwhal: reload: {'changed ' + ', '.join(changed) if changed else 'no setting changed'}",
          file=sys.stderr, flush=True)
    return settings


def reload_refusal() -> str | None:
    """Why the settings file as it stands would be refused by a reload (None: it would be
    taken): asked before gunicorn replaces a single worker (``master.arbiter``)."""
    try:
        settings = load_settings()
        _check_room(settings)
    except SettingsError as exc:
        return str(exc)
    return None


def _assign_engine_slots(settings: Settings) -> None:
    """The engine table (``shm.table``): kept engines keep their slots, removed ones retire,
    new ones take a free one; no room is a refused reload (or start), one line. With discovery
    on, the engines the supervisor discovered stay (unless a static entry now has their name or
    URL: static wins), and the epoch moves once the static engines' descriptors are written, so
    running workers take up the new list (``worker.roster_follow``)."""
    from narwhal import shm
    from narwhal.fleet import Fleet
    from narwhal.shm import descriptors
    from narwhal.shm.layout import TABLE_EPOCH_OFFSET, TABLE_LOCK
    from narwhal.shm.table import TableFull

    shared = shm.SHARED
    if shared is None:
        return
    static = [(e.name, e.url) for e in Fleet(settings).engines]
    taken = {n for n, _ in static} | {u for _, u in static}
    try:
        # Every description encoded before the table is touched: a refused one (too long) must
        # leave a reload wholly unapplied, not half.
        encoded = [descriptors.encode(spec.model_dump(), "static") for spec in settings.engines]
        with shared.locked(TABLE_LOCK):  # one table writer at a time: the supervisor writes it too
            kept = [] if not settings.discovery.enabled else [
                (entry["name"], entry["url"]) for _, entry, source in shared.described()
                if source != "static" and entry["name"] not in taken and entry["url"] not in taken]
            slots = shared.assign_engines(static + kept)
            for raw, slot in zip(encoded, slots, strict=False):
                descriptors.write(shared.region, slot, raw)
            if settings.discovery.enabled:
                shared.region.set_u32(TABLE_EPOCH_OFFSET, shared.table.epoch + 1)
    except (TableFull, descriptors.DescriptorTooLong) as exc:
        raise SettingsError(f"engines: {exc}") from None


def _check_room(settings: Settings) -> None:
    """A reload starts ``server.workers`` new workers beside the running ones, each needing a slot.
    Within ``MAX_WORKERS`` that always fits (twice as many slots); workers added by ``TTIN``
    may not leave room, and a worker without a slot would escape the fleet's state for good."""
    from narwhal import shm

    if shm.SHARED is None:
        return
    running, slots = len(shm.SHARED.claimed_slots()), shm.SHARED.layout.slots
    if settings.server.workers + running > slots:
        raise SettingsError(f"server.workers: {settings.server.workers} new workers beside the {running} running "
                            f"ones exceed the shared layout's {slots} worker slots")


def gunicorn_settings() -> dict[str, Any]:
    """gunicorn's configuration from Narwhal's settings; read by ``gunicorn_conf`` in the master."""
    settings = _load()
    remember(settings)
    _prepare_metrics_dir()
    return {
        "wsgi_app": "narwhal.app:create_app",  # the documented path (narwhal/app.py re-exports it)
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
        "accesslog": None,  # Narwhal writes its own access log (log.access_log)
        # gunicorn's own lines through Narwhal's JSON formatter in json mode (narwhal.master.gunicorn_logging).
        "logger_class": "narwhal.master.gunicorn_logging.JsonLogger" if settings.log.format == "json"
        else "gunicorn.glogging.Logger",
        "loglevel": settings.log.level,
        "limit_request_field_size": settings.server.max_header_bytes,
    }


# gunicorn re-executes a config given as a *file* on SIGHUP (one given as python:module is
# imported once and never re-read), so Narwhal always passes the file.
CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gunicorn_conf.py")

_KEEPER: list[Any] = []  # the master's SupervisorKeeper, once on_starting made it


def reconcile(settings: Settings, cfg: Any) -> tuple[Settings, list[str]]:
    """gunicorn's own options (``--workers``, ``--bind``, ``--graceful-timeout``, on its command
    line or in ``GUNICORN_CMD_ARGS``) override what this configuration derived from the
    settings. They win, visibly and consistently: each override is one line on stderr, and
    the settings every Narwhal process runs on (workers, supervisor, the shared layout's
    slot count, the drain timers) are rewritten to match what gunicorn will actually do."""
    server = settings.server
    changes: dict[str, Any] = {}
    if cfg.workers != server.workers:
        changes["workers"] = cfg.workers
    binds = list(cfg.bind or [])
    if binds and binds != [server.bind]:
        changes["bind"] = binds[0]
    if cfg.graceful_timeout != math.ceil(server.graceful_timeout_s):
        changes["graceful_timeout_s"] = float(cfg.graceful_timeout)
    lines = [
        f"narwhal: gunicorn's {_FLAG[key]} {cfg_value} overrides server.{key} = {getattr(server, key)!r}"
        for key, cfg_value in (("workers", cfg.workers), ("bind", ",".join(binds)),
                               ("graceful_timeout_s", cfg.graceful_timeout))
        if key in changes
    ]
    if not changes:
        return settings, []
    return settings.model_copy(update={"server": server.model_copy(update=changes)}), lines


_FLAG = {"workers": "--workers", "bind": "--bind", "graceful_timeout_s": "--graceful-timeout"}


def _adopt_gunicorn_options(server: Any) -> Settings:
    from narwhal.settings import current_or_load

    settings, lines = reconcile(current_or_load(), server.cfg)
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    remember(settings)
    return settings


def on_starting(server: Any) -> None:
    """In the master, before the listening sockets exist: shared memory, then the supervisor."""
    from narwhal import shm
    from narwhal.master.keeper import SupervisorKeeper
    from narwhal.shm.layout import WORKER_SLOTS
    from narwhal.shm.shared import SharedFleet

    settings = _adopt_gunicorn_options(server)
    if settings.server.workers > MAX_WORKERS:  # gunicorn's --workers: settings validation never saw it
        print(f"narwhal: invalid settings: gunicorn's --workers {settings.server.workers} exceeds the limit of "
              f"server.workers ({MAX_WORKERS})", file=sys.stderr, flush=True)
        raise SystemExit(2)
    # Room for any reload: old and new workers side by side, engines added up to max_engines.
    refusal = settings.discovery.refusal(len(settings.engines))
    if refusal is not None:
        print(f"narwhal: invalid settings: {refusal}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    # Room for any reload: old and new workers side by side, engines added up to max_engines
    # (discovery.max_engines once engines come and go at run time).
    shm.SHARED = SharedFleet.create(engines=settings.engine_slots, slots=WORKER_SLOTS)
    try:
        _assign_engine_slots(settings)  # before anything forks: every process looks its engines up
    except SettingsError as exc:  # an engine's description too long for its slot: one line, no traceback
        print(f"narwhal: invalid settings: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    shm.POLICY_REGION = create_policy_region(settings, shm.SHARED.layout.slots, shm.SHARED.layout.engines)
    _warn_never_ejected(settings)
    if settings.preflight.on_start and settings.engines:
        from narwhal.master.startup import preflight_on_start

        # Before any worker exists, so an engine that fails starts ejected everywhere.
        preflight_on_start(shm.SHARED, settings)
    keeper = SupervisorKeeper(shm.SHARED)
    keeper.start()
    _KEEPER[:] = [keeper]
    arbiter.adapt(server, keeper, reload_refusal)


def _warn_never_ejected(settings: Settings) -> None:
    """Once, in the master: each role ``max_ejected_fraction`` can never eject (docs/behaviour.md "Recovery")."""
    from narwhal.logs import master_line
    from narwhal.supervisor.breaker import never_ejected

    engines = [(e.name, e.role) for e in settings.engines]
    for line in never_ejected(engines, settings.recovery.max_ejected_fraction):
        print(master_line("warning", "narwhal.supervisor.breakers", line), file=sys.stderr, flush=True)


def create_policy_region(settings: Settings, slots: int, engines: int | None = None) -> Any:
    """The placement policy's own shared memory beside the fleet's, when it asks for some
    (``Policy.region``: the master knows no policy and builds what the policy names), sized
    for ``slots`` workers and ``engines`` engine slots (default the configured engines)."""
    from narwhal.fleet.placement.policy import part
    from narwhal.fleet.placement.registry import region

    need = region(settings.placement)
    return None if need is None else part(need.create)(need, settings, slots, engines)


def on_reload(server: Any) -> None:
    """SIGHUP: the settings were re-read (``gunicorn_settings``); gunicorn's options win again,
    and the supervisor restarts on them (new workers read them too)."""
    _adopt_gunicorn_options(server)
    if _KEEPER:
        _KEEPER[0].reload()


def nworkers_changed(server: Any, new_value: int, old_value: int | None) -> None:
    """TTIN/TTOU change the worker count at run time; beyond the layout's slots a worker
    would run on per-process state, so say so where the operator looks."""
    from narwhal import shm

    if old_value is not None and shm.SHARED is not None and new_value > shm.SHARED.layout.slots:
        print(f"narwhal: {new_value} workers exceed the shared layout's {shm.SHARED.layout.slots} slots: "
              "the extra workers keep per-process state; restart to grow the layout", file=sys.stderr, flush=True)


def child_exit(server: Any, worker: Any) -> None:
    """gunicorn, in the master, a worker gone: free its slot (it was the slot's one writer), mark its metrics dead."""
    from narwhal import shm

    if shm.SHARED is not None:
        # The worker is gone: give back whatever it held (its slot has no other writer now).
        for slot in range(shm.SHARED.in_use()):
            if shm.SHARED.slot_pid(slot) == worker.pid:
                if shm.POLICY_REGION is not None:  # before the slot can be claimed again: its work was this worker's
                    shm.POLICY_REGION.worker_gone(slot)
                shm.SHARED.release(slot, worker.pid)
    if os.environ.get(_PROM_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    """gunicorn, the master leaving: stop the supervisor; remove the metrics directory if Narwhal made it."""
    if _KEEPER:
        _KEEPER.pop().stop()
    path = os.environ.get(_PROM_ENV)
    if path and os.environ.get(_OWNED_ENV) == "owned":
        shutil.rmtree(path, ignore_errors=True)
