"""gunicorn's logger: JSON through Narwhal's formatter in json mode, gunicorn's own in text mode."""

from __future__ import annotations

import io
import logging

import orjson
import pytest
from gunicorn.config import Config

from narwhal.master import gunicorn_hooks
from narwhal.master.gunicorn_logging import JsonLogger
from narwhal.settings import load_settings


@pytest.mark.parametrize(("fmt", "cls"), [("json", "narwhal.master.gunicorn_logging.JsonLogger"),
                                          ("text", "gunicorn.glogging.Logger")])
def test_the_logger_class_follows_log_format(monkeypatch: pytest.MonkeyPatch, fmt: str, cls: str) -> None:
    settings = load_settings(None, environ={"NARWHAL_LOG__FORMAT": fmt})
    monkeypatch.setattr(gunicorn_hooks, "_load", lambda: settings)
    monkeypatch.setattr(gunicorn_hooks, "_prepare_metrics_dir", lambda: None)
    monkeypatch.setattr(gunicorn_hooks, "remember", lambda s: None)
    assert gunicorn_hooks.gunicorn_settings()["logger_class"] == cls


def test_gunicorn_error_lines_come_out_as_narwhal_json(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config()
    cfg.set("errorlog", "-")
    cfg.set("loglevel", "info")
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    logger = JsonLogger(cfg)
    logger.info("Booting worker with pid: %s", 42)
    line = orjson.loads(out.getvalue().strip().splitlines()[-1])
    assert set(line) == {"ts", "level", "logger", "message"}
    assert (line["level"], line["logger"], line["message"]) == ("info", "gunicorn.error", "Booting worker with pid: 42")
    logging.getLogger("gunicorn.error").handlers.clear()  # nothing of this test's setup outlives it
