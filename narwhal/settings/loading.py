"""Loading the settings: a TOML file overridden by ``NARWHAL_`` environment variables.

Why this module is stricter than pydantic-settings out of the box:

* every model forbids unknown keys (``settings.section``), because a typo in a TOML file (``first_token_timeout``
  for ``first_token_timeout_s``) would otherwise be dropped silently and the router would run
  on a default nobody chose;
* pydantic-settings silently ignores environment variables it does not know and a TOML file
  that does not exist, so both are checked by hand (the variables, names and the form of list
  and object values, in :mod:`narwhal.settings.env`);
* an invalid value must stop the start with *one line naming the key*, never a traceback:
  :func:`load_settings` raises :class:`SettingsError` whose message is that line, and
  :func:`load_settings_or_exit` prints it and exits with status 2.
"""

from __future__ import annotations

import os
import sys
import tomllib
from typing import Any

from pydantic import ValidationError

from narwhal.settings import hints as settings_hints
from narwhal.settings.env import CONFIG_ENV, check_environment, source_of
from narwhal.settings.root import Settings


class SettingsError(Exception):
    """An invalid setting; ``str(exc)`` is a single line that names the key."""


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"config: file not found: {path}") from None
    except OSError as exc:
        raise SettingsError(f"config: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config: {path} is not valid TOML: {exc}") from None


def _first_error_line(exc: ValidationError, environ: dict[str, str]) -> str:
    err = exc.errors()[0]
    msg, hint = err["msg"], ""
    if (better := settings_hints.explain(exc.errors(), Settings)) is not None:
        err, msg, hint = better  # what was meant: [[engines]], a "did you mean" (narwhal.settings_hints)
    elif err["type"] == "extra_forbidden":
        msg = "unknown setting"
    loc = ".".join(str(p) for p in err["loc"])
    source = source_of(err["loc"], environ)
    where = f" (from {source})" if source is not None else ""
    if not loc:
        return msg.removeprefix("Value error, ")
    return f"{loc}: {msg.removeprefix('Value error, ')}{where}{hint}"


def load_settings(path: str | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Load settings from ``path`` (or ``$NARWHAL_CONFIG``) and the environment; an invalid one raises
    :class:`SettingsError` with a one-line message naming the offending key."""
    env = dict(os.environ if environ is None else environ)
    path = path or env.get(CONFIG_ENV) or None
    document = _read_toml(path) if path else {}
    try:
        check_environment(env, Settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    saved = os.environ.copy() if environ is not None else None
    try:
        if saved is not None:
            os.environ.clear()
            os.environ.update(env)
        return Settings(**document)
    except ValidationError as exc:
        raise SettingsError(_first_error_line(exc, env)) from None
    finally:
        if saved is not None:
            os.environ.clear()
            os.environ.update(saved)


def load_settings_or_exit(path: str | None = None) -> Settings:
    """The start-up form: print one line and exit 2 on any invalid setting."""
    try:
        return load_settings(path)
    except SettingsError as exc:
        print(f"narwhal: invalid settings: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


# What the master loaded before forking: a worker runs on exactly what the master validated.
_current: Settings | None = None


def remember(settings: Settings) -> None:
    """Master only, before forking: what its children inherit (a SIGHUP reload swaps them for new ones)."""
    global _current
    _current = settings


def current() -> Settings | None:
    """The settings the master remembered; None in a process no master forked (tests, tools)."""
    return _current


def current_or_load() -> Settings:
    """The remembered settings, else loaded now (exit 2 if invalid): the same call inside gunicorn and out."""
    return _current if _current is not None else load_settings_or_exit()
