"""Unit tests: the app's routes, the accept loop, the gunicorn hooks."""
