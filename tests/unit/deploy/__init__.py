"""Unit tests: deploy/, the image, alert rules, engine recipes."""
