"""What every settings section is: a frozen model that refuses unknown keys.

Why refuse them: a typo in a TOML file (``first_token_timeout`` for ``first_token_timeout_s``)
would otherwise be dropped silently, and the router would run on a default nobody chose. Why
frozen: the settings are read by every process after the fork, and one shared object nobody
can change is one nobody has to reason about.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveFloat = Annotated[float, Field(gt=0)]
"""A float above 0 (a timeout, an interval)."""

NonNegativeFloat = Annotated[float, Field(ge=0)]
"""A float of 0 or more (0: the feature is off)."""


class Section(BaseModel):
    """A settings section (``[server]``, ``[[engines]]`` …): frozen, unknown keys refused."""

    # A field's docstring (the string under it) is its description: docs/settings.md is rendered from them.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
