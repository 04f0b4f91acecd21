"""Docs rendered from the code's own tables match what is committed (``narwhal.fault_table``).

Why: the fault table lived in two docs and the copies drifted from each other and from the
code. Each copy is now rendered from ``narwhal.reasons``; this fails when one differs, and says
the command that rewrites them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal import fault_table
from narwhal.reasons import TABLE, Reason

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
