"""Narwhal's settings: a TOML file overridden by ``NARWHAL_`` environment variables. Its modules:

- ``loading.py``: ``load_settings``: the file and the environment, one line naming the key on error
- ``root.py``: ``Settings``, every section validated as a whole
- ``sections.py``: ``[server]``, ``[request]``, ``[engine]``, ``[handoff]``, ``[preflight]``, ``[log]``,
  ``[tracing]``, ``[recovery]``, ``[compat]``
- ``placement.py``: ``[placement]`` and ``[placement.held]``
- ``engines.py``: an ``[[engines]]`` entry and the engine contract
- ``discovery.py``: ``[discovery]``: the file, DNS and Kubernetes sources
- ``section.py``: what every section shares (unknown keys forbidden, frozen)
- ``env.py``: the ``NARWHAL_`` variables, checked by hand
- ``hints.py``: what a mistyped key probably meant
- ``effective.py``: the running settings as an operator sees them (secrets redacted), what a reload changed
- ``reference.py``: docs/settings.md's table, rendered from the models
"""

from narwhal.settings.loading import (
    SettingsError,
    current,
    current_or_load,
    load_settings,
    load_settings_or_exit,
    remember,
)
from narwhal.settings.placement import HeldSettings, PlacementSettings
from narwhal.settings.root import Settings
from narwhal.settings.sections import (
    MAX_WORKERS,
    CompatSettings,
    EngineSettings,
    HandoffSettings,
    LogSettings,
    PreflightSettings,
    RecoverySettings,
    RequestSettings,
    ServerSettings,
    TracingSettings,
)

__all__ = [
    "MAX_WORKERS",
    "CompatSettings",
    "EngineSettings",
    "HandoffSettings",
    "HeldSettings",
    "LogSettings",
    "PlacementSettings",
    "PreflightSettings",
    "RecoverySettings",
    "RequestSettings",
    "ServerSettings",
    "Settings",
    "SettingsError",
    "TracingSettings",
    "current",
    "current_or_load",
    "load_settings",
    "load_settings_or_exit",
    "remember",
]
