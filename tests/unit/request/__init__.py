"""Unit tests: admission, the access log."""
