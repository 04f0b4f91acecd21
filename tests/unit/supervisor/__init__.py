"""Unit tests: the supervisor's keeper."""
