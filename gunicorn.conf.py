# gunicorn -c gunicorn.conf.py   — the router under gunicorn, configured from Narwhal's settings
# (NARWHAL_CONFIG=path/to/narwhal.toml and NARWHAL_* variables). The real configuration is
# narwhal/master/gunicorn_conf.py; it is re-run here on every start and SIGHUP reload.
import runpy

from narwhal.master.gunicorn_hooks import CONFIG_FILE

globals().update({k: v for k, v in runpy.run_path(CONFIG_FILE).items() if not k.startswith("__")})
