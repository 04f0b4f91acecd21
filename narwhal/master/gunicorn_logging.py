"""gunicorn's own log lines (master and workers: booting, signals, worker exits) as JSON.

With ``log.format = "json"`` the configuration names :class:`JsonLogger` as gunicorn's
``logger_class``: gunicorn sets up its error log as usual (target, level, reopening on
``SIGUSR1``), and every handler it made then formats with Narwhal's
:class:`narwhal.logs.JsonFormatter`, so one parser reads the whole stderr. gunicorn's access
log stays off: Narwhal writes its own (``log.access_log``).
"""

from __future__ import annotations

from typing import Any

from gunicorn.glogging import Logger

from narwhal.logs import JsonFormatter


class JsonLogger(Logger):  # type: ignore[misc]
    """gunicorn's logger, every handler it sets up formatting as Narwhal's JSON lines."""

    def setup(self, cfg: Any) -> None:
        """gunicorn's set-up (targets, levels, reopening), then the JSON formatter on each handler."""
        super().setup(cfg)
        for log in (self.error_log, self.access_log):
            for handler in log.handlers:
                handler.setFormatter(JsonFormatter())
