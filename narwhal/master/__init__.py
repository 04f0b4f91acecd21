"""What runs in the gunicorn master: its hooks (``gunicorn_hooks``, configured by
``gunicorn_conf``), gunicorn's own log lines as JSON, the start-up preflight (``startup``) and
the keeper that forks, watches and restarts the supervisor (``keeper``).

May import every layer below it (the worker's app, the supervisor's process body)."""
