"""The running settings as an operator may see them: secrets redacted, and what a reload changed.

Why: an operator new to Narwhal had only curl and JSON to see the fleet, and a reload logged
nothing about what it changed. ``GET /admin/settings`` (and ``narwhal status --settings``)
shows :func:`redacted`; a SIGHUP reload logs :func:`changed_keys`.

Invariant: pure; no secret (the admin token, client API keys, the engines' key) ever leaves here
unredacted, whatever its value.
"""

from __future__ import annotations

from typing import Any

from narwhal.settings import Settings

REDACTED = "<redacted>"
_SECRETS = (("server", "admin_token"), ("server", "api_keys"), ("engine", "api_key"))


def redacted(settings: Settings) -> dict[str, Any]:
    """Every key of ``settings`` as JSON values, each secret that is set replaced by :data:`REDACTED`."""
    out = settings.model_dump(mode="json")
    for section, key in _SECRETS:
        value = out.get(section, {}).get(key)
        if isinstance(value, list):
            out[section][key] = [REDACTED for _ in value]
        elif value:
            out[section][key] = REDACTED
    return out


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """The dotted keys whose values differ between ``old`` and ``new`` (a list, such as
    ``engines``, is one key), in order; secrets named, never shown."""
    changed: list[str] = []
    _walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "", changed)
    return changed


def _walk(old: Any, new: Any, prefix: str, changed: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in dict.fromkeys([*old, *new]):
            _walk(old.get(key), new.get(key), f"{prefix}{key}.", changed)
    elif old != new:
        changed.append(prefix.rstrip("."))
