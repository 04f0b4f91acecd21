"""Settings errors that say what was meant: the one start-up line, when pydantic's would puzzle.

Why: pydantic describes what it got, not what the operator wrote. ``[engines]`` (one table)
instead of ``[[engines]]`` (an array of tables) answers "Input should be a valid list", and
``[[engine]]`` answers "…instance of EngineSettings"; a typo answers "unknown setting" without
saying which key exists. These rules read the settings models themselves (never a list kept by
hand), so a new setting is suggested as soon as it exists. Pure: an error in, a line out.
"""

from __future__ import annotations

import difflib
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

Loc = tuple[int | str, ...]


def explain(errors: list[ErrorDetails], root: type[BaseModel]) -> tuple[ErrorDetails, str, str] | None:
    """The error to report, its message and a "; did you mean …?" (or ""), when a rule here
    knows better than pydantic."""
    first = errors[0]
    if first["type"] == "missing":  # a typo of a required key shows as missing + unknown: the typo is the cause
        parent = first["loc"][:-1]
        typo = next((e for e in errors if e["type"] == "extra_forbidden" and e["loc"][:-1] == parent
                     and _close(str(e["loc"][-1]), [str(first["loc"][-1])])), None)
        first = typo or first
    found = _explain_one(first, root)
    return None if found is None else (first, *found)


def _explain_one(err: ErrorDetails, root: type[BaseModel]) -> tuple[str, str] | None:
    loc, kind, value = err["loc"], err["type"], err.get("input")
    if kind == "extra_forbidden":
        return _unknown(loc, value, root)
    field = _field(root, loc)
    if field is None:
        return None
    name = _path(loc)
    if kind == "list_type" and isinstance(value, dict) and _model_of(field, listed=True) is not None:
        return f"write [[{name}]] (an array of tables, one per entry), not the single table [{name}]", ""
    if kind == "model_type" and isinstance(value, list) and _model_of(field, listed=False) is not None:
        arrays = [n for n, f in _fields(root, loc[:-1]).items() if _model_of(f, listed=True) is not None]
        mean = _close(str(loc[-1]), arrays)
        hint = f"; did you mean [[{_path((*loc[:-1], mean[0]))}]]?" if mean else ""
        return f"[{name}] is one table, not the array of tables [[{name}]]", hint
    return None


def _unknown(loc: Loc, value: Any, root: type[BaseModel]) -> tuple[str, str]:
    key, parent = str(loc[-1]), loc[:-1]
    known = _fields(root, parent)
    table = isinstance(value, dict)
    what = "unknown table" if table else "unknown setting"
    mean = _close(key, [n for n, f in known.items() if table == (_model_of(f, listed=False) is not None)])
    if mean:
        suggestion = _path((*parent, mean[0]))
        return what, f"; did you mean {f'[{suggestion}]' if table else suggestion}?"
    if not parent and not table:  # a key above every table: name the table it belongs in
        owners = [n for n, f in known.items() if (m := _model_of(f, listed=False)) and key in m.model_fields]
        if owners:
            return what, f"; did you mean {owners[0]}.{key} (under [{owners[0]}])?"
    return what, ""


def _close(word: str, candidates: list[str]) -> list[str]:
    return difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)


def _path(loc: Loc) -> str:
    return ".".join(str(p) for p in loc)


def _fields(root: type[BaseModel], loc: Loc) -> dict[str, Any]:
    """The fields of the model at ``loc`` (list indices skipped), by name with their annotations."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _model_of(field.annotation, listed=None) if field is not None else None
    return {} if model is None else {n: f.annotation for n, f in model.model_fields.items()}


def _field(root: type[BaseModel], loc: Loc) -> Any:
    return _fields(root, loc[:-1]).get(str(loc[-1])) if loc and not isinstance(loc[-1], int) else None


def _model_of(annotation: Any, *, listed: bool | None) -> type[BaseModel] | None:
    """The model an annotation holds: as a table (``listed`` False), in a list (True), or either."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation if listed is not True else None
    origin = get_origin(annotation)
    if origin is list:
        return None if listed is False else _model_of(get_args(annotation)[0], listed=False)
    if origin in (Union, types.UnionType):
        return next((m for a in get_args(annotation) if (m := _model_of(a, listed=listed)) is not None), None)
    return None
