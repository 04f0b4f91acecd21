"""The environment's half of the settings: every ``NARWHAL_`` variable checked before
pydantic-settings reads it, so that a bad one is one line naming it, never a traceback.

Why by hand: pydantic-settings drops variables it does not know silently, and a value it must
decode as JSON (a list such as ``server.api_keys``, an object such as ``engine_contract``, a
whole section) that is not JSON makes it raise its own ``SettingsError`` — a traceback that
names neither the variable nor the form it wanted. So each variable is resolved here to the
setting it names, through the settings model itself (no second list of names to keep in step):

* a name that is no setting, or that goes inside a list or a plain value
  (``NARWHAL_ENGINES__0__NAME``: pydantic-settings has no list indices), is refused;
* a value for a list or object setting must be JSON of that kind, and the line says the form:
  ``server.api_keys: expected a JSON list of strings, such as ["key1", "key2"] (from
  NARWHAL_SERVER__API_KEYS)``. Only JSON: a comma list would make a key holding a comma
  ambiguous, and one syntax is what pydantic-settings documents.

A key a section moved into a table of its own (its model's ``MOVED``: ``placement.block_chars``
is ``placement.held.block_chars``) is refused with the variable to set instead: a TOML file's
old key is still read (the section takes it over), but a variable cannot be renamed silently.

Plain values (numbers, booleans, strings) are pydantic's to judge; its errors are then named
by :func:`source_of`. Names are matched case-insensitively, as pydantic-settings matches them.
"""

from __future__ import annotations

import json
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

ENV_PREFIX = "NARWHAL_"
CONFIG_ENV = "NARWHAL_CONFIG"
DELIMITER = "__"
_ENGINE_EXAMPLE = '[{"name": "p0", "url": "http://10.0.0.5:8100", "role": "producer"}]'


def _unwrap(annotation: Any) -> Any:
    """``X | None`` → ``X``: an optional setting takes the form of what it holds."""
    if get_origin(annotation) in (Union, types.UnionType):
        held = [a for a in get_args(annotation) if a is not type(None)]
        if len(held) == 1:
            return held[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _form(annotation: Any) -> tuple[type, str] | None:
    """(the JSON kind, the form in words) a variable for ``annotation`` must hold; None for a
    plain value, which pydantic judges."""
    if _is_model(annotation):
        first = next(iter(annotation.model_fields))
        return dict, f'a JSON object of its keys, such as {{"{first}": ...}}'
    if get_origin(annotation) is list:
        item = get_args(annotation)[0]
        if item is str:
            return list, 'a JSON list of strings, such as ["key1", "key2"]'
        if _is_model(item):
            return list, f"a JSON list of objects, such as {_ENGINE_EXAMPLE}"
        return list, "a JSON list"
    return None


def _variable(path: list[str]) -> str:
    return ENV_PREFIX + DELIMITER.join(path).upper()


def _check_one(name: str, value: str, model: type[BaseModel]) -> None:
    """Resolve ``name`` through ``model``'s fields, then check ``value``'s form."""
    path: list[str] = []
    annotation: Any = model
    optional = False
    for part in name[len(ENV_PREFIX):].lower().split(DELIMITER):
        if not _is_model(annotation):
            # pydantic-settings cannot set a list's item or a plain value's part.
            raise ValueError(f"{name}: unknown setting; {'.'.join(path)} is set whole, in {_variable(path)}")
        fields = annotation.model_fields
        if part not in fields:
            moved = getattr(annotation, "MOVED", {}).get(part)  # a key a section gave to a table of its own
            if moved is not None:
                now = [*path, *moved.split(".")]
                raise ValueError(f"{name}: {'.'.join([*path, part])} moved to {'.'.join(now)}: set {_variable(now)}")
            setting = f" {'.'.join([*path, part])}" if path else ""
            raise ValueError(f"{name}: unknown setting{setting}")
        path.append(part)
        annotation = _unwrap(fields[part].annotation)
        optional = annotation is not fields[part].annotation
    form = _form(annotation)
    if form is None:
        return
    kind, words = form
    try:
        decoded = json.loads(value)
    except ValueError:
        decoded = value  # not JSON, so not of the kind either
    if not isinstance(decoded, kind) and not (decoded is None and optional):
        raise ValueError(f"{'.'.join(path)}: expected {words} (from {name})")


def check_environment(environ: dict[str, str], model: type[BaseModel]) -> None:
    """Refuse the first ``NARWHAL_`` variable of ``environ`` that names no setting of ``model``
    or holds the wrong form (ValueError, whose message is the one line)."""
    for name, value in environ.items():
        if name.upper().startswith(ENV_PREFIX) and name.upper() != CONFIG_ENV:
            _check_one(name, value, model)


def source_of(loc: tuple[Any, ...], environ: dict[str, str]) -> str | None:
    """The variable a setting at ``loc`` came from, if one did: itself or the one that set an
    enclosing setting whole (``NARWHAL_ENGINES`` for ``engines.0.url``)."""
    names = {name.upper(): name for name in environ}
    for end in range(len(loc), 0, -1):
        found = names.get(ENV_PREFIX + DELIMITER.join(str(p) for p in loc[:end]).upper())
        if found is not None:
            return found
    return None
