"""gunicorn's app path ``narwhal.app:create_app`` (also in operators' own configurations):
the application lives in :mod:`narwhal.worker.app`."""

from narwhal.worker.app import create_app

__all__ = ["create_app"]
