"""Unit tests: the perf suite's report."""
