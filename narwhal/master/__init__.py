"""What runs in the gunicorn master: its hooks (``gunicorn_hooks``, configured by
``gunicorn_conf``), what Narwhal changes in gunicorn's Arbiter (``arbiter``), gunicorn's own log
lines as JSON, the start-up preflight (``startup``) and the keeper that forks, watches and
restarts the supervisor (``keeper``).

May import every layer below it (the worker's app, the supervisor's process body).

Its modules: what the gunicorn master runs: ``gunicorn_hooks.py`` + ``gunicorn_conf.py`` (settings,
shared memory, reloads; the worker's own hook is ``worker/lifecycle.py``; gunicorn's
``--workers/--bind/--graceful-timeout`` reconciled into the settings), ``arbiter.py`` (all Narwhal
changes in gunicorn's Arbiter: four methods of the running master wrapped, the keeper's check, the
stop, the stop signals held across a fork), ``keeper.py`` (``SupervisorKeeper``: fork, watch by
pidfd and heartbeat, restart the supervisor), ``startup.py`` (preflight at start: failing engines
start ejected), ``gunicorn_logging.py`` (gunicorn's own lines as JSON)
"""
