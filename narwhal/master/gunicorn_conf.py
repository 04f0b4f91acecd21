"""gunicorn configuration, read from Narwhal's settings (``gunicorn -c gunicorn.conf.py``).

gunicorn executes this module in the master at start and again on every ``SIGHUP``; the
settings are loaded (and validated: one line and exit 2 on a bad value) each time, so a
reload picks up a changed TOML file. Hooks only wire process events to
``narwhal.master.gunicorn_hooks`` (the master's) and ``narwhal.worker.lifecycle`` (each
worker's); no request logic lives here.
"""

from narwhal.master.gunicorn_hooks import (  # noqa: F401
    child_exit,
    gunicorn_settings,
    nworkers_changed,
    on_exit,
    on_reload,
    on_starting,
)
from narwhal.worker.lifecycle import post_worker_init  # noqa: F401  (run in each worker)

globals().update(gunicorn_settings())
