"""Unit tests: the fake vLLM engine."""
