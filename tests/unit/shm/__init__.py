"""Unit tests: the shared-memory layout and records."""
