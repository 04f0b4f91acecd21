"""Unit tests: placement, breakers and blame (pure decisions)."""
