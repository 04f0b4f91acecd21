# gunicorn -c gunicorn.conf.py   — the router under gunicorn, configured from Narwhal's settings
# (NARWHAL_CONFIG=path/to/narwhal.toml and NARWHAL_* variables). See narwhal/gunicorn_conf.py.
from narwhal.gunicorn_conf import *  # noqa: F401,F403
