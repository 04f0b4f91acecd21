"""Docs rendered from the code's own tables match what is committed (``narwhal.fault_table``,
``narwhal.settings.reference``).

Why: the fault table lived in two docs and the copies drifted from each other and from the
code; docs/settings.md gave a default that had changed and left a key out. Each is now rendered
from the code (the reasons; the settings models' defaults and field docstrings); this fails when
a committed copy differs, and says the command that rewrites it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from narwhal import fault_table
from narwhal.reasons import TABLE, Reason
from narwhal.settings import Settings, reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", fault_table.DOCS)
def test_the_fault_table_in_each_doc_is_the_rendered_one(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert fault_table.rewrite(text) == text, f"{doc}: run `python -m narwhal.fault_table --write`"


def test_the_table_shows_every_fault_a_client_can_meet_from_an_engine() -> None:
    rendered = fault_table.render()
    for rule in TABLE:
        if rule.counts and rule.ring_code is not None and rule.name not in ("health_check", "probe", "preflight"):
            assert rule.rows, f"{rule.name} counts against engines but has no line in the table"
    for rule in TABLE:
        for what, sees in rule.rows:
            assert f"| {what} | {sees} |" in rendered
    assert f"`{Reason.HANDOFF_EXPIRED}` (the handoff is sent nowhere" in rendered  # the copies once disagreed


def test_a_doc_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="markers"):
        fault_table.rewrite("| what happened | client sees |\n")


def test_the_settings_table_is_the_rendered_one() -> None:
    text = (ROOT / reference.DOC).read_text()
    assert reference.rewrite(text) == text, "docs/settings.md: run `python -m narwhal.settings.reference --write`"


def test_every_setting_is_described_with_its_default() -> None:
    table = reference.render()
    assert "| `handoff.max_age_s` | 20 |" in table and "| `handoff.lease_s` | 30 |" in table  # once drifted
    assert "| `placement.held.block_chars` | 256 |" in table  # a table within a section, key by key

    def keys(annotation: Any) -> int:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return sum(keys(f.annotation) for f in annotation.model_fields.values())
        return 1

    assert len(reference.rows()) == sum(keys(f.annotation) for f in Settings.model_fields.values())


def test_a_setting_without_a_description_is_refused() -> None:
    class Bare(BaseModel):
        key: int = 1

    with pytest.raises(ValueError, match="x.key: no description"):
        reference._description("x.key", Bare.model_fields["key"])
