"""The router's own log lines (not the access log): level and format from ``[log]``.

In ``json`` mode every line a Narwhal process writes for an operator is one JSON object with
``ts``, ``level``, ``logger`` and ``message``: Narwhal's loggers, gunicorn's own error log
(``narwhal.master.gunicorn_logging``), the start-up preflight report (:func:`json_line`) and the
master's own lines about its supervisor (:func:`master_line`).
The one-line settings errors stay plain: they are written before any format is known.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time

import orjson

from narwhal.settings import LogSettings, current


def json_line(level: str, logger: str, message: str, **extra: object) -> str:
    """One log line in the JSON shape of :class:`JsonFormatter`, for writers outside ``logging``."""
    return orjson.dumps({"ts": round(time.time(), 6), "level": level, "logger": logger, "message": message,
                         **extra}).decode()


def master_line(level: str, logger: str, message: str) -> str:
    """A line the gunicorn master writes outside ``logging``, in the running settings' format:
    :func:`json_line` in ``json`` mode, else ``narwhal: <message>`` as before."""
    settings = current()
    if settings is not None and settings.log.format == "json":
        return json_line(level, logger, message)
    return f"narwhal: {message}"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ``ts``, ``level``, ``logger``, ``message`` (and ``exception``)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON object on one line; a traceback goes in ``exception``, not on new lines."""
        line = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure_logging(settings: LogSettings) -> None:
    """Point the ``narwhal`` loggers at stderr in the ``[log]`` format and level, and nowhere else."""
    handler = logging.StreamHandler(sys.stderr)
    if settings.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    logger = logging.getLogger("narwhal")
    logger.handlers[:] = [handler]
    logger.setLevel(settings.level.upper())
    logger.propagate = False


def first_across_processes(key: str) -> bool:
    """True for the first process of this router to ask with ``key``, False for every later ask,
    in any worker, for the router's life (reloads included): "once per engine" warnings are once
    across the router, not once per worker (docs/behaviour.md). The mark is a file created with
    ``O_EXCL`` in the router's own directory (the metrics' multiprocess directory, which the
    master makes per run): atomic across processes, and asked only on the rare path of a
    warning. Without that directory (one process), every ask is the first: the caller's own
    memory keeps it once."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return True
    name = ".once-" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    try:
        os.close(os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True  # the directory went away or is not ours to write: warn rather than stay silent
    return True

