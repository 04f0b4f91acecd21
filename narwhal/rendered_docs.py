"""A table the docs show, rendered from the code: replaced between two markers, printed or written.

``narwhal.fault_table`` (the reasons' table, in README.md and docs/behaviour.md) and
``narwhal.settings.reference`` (every key, in docs/settings.md) render their tables; this holds
what they share: the markers' rewrite and the command line (print, or ``--write`` the docs).
``tests/unit/test_generated_docs.py`` compares each committed copy with its rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path


def rewrite(text: str, begin: str, end: str, rendered: str, what: str) -> str:
    """``text`` with what lies between ``begin`` and ``end`` replaced by ``rendered``; the markers
    must be there (``what`` names the table in the error)."""
    head, found_begin, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the {what}'s markers are missing")
    return f"{head}{begin}\n{rendered}\n{end}{tail}"


def command(argv: Sequence[str], render: Callable[[], str], rewrite_doc: Callable[[str], str],
            docs: Sequence[str]) -> int:
    """Print the rendering; with ``--write``, rewrite it in ``docs`` of a checkout (run from its root)."""
    if "--write" not in argv:
        print(render())
        return 0
    for name in docs:
        path = Path(name)
        path.write_text(rewrite_doc(path.read_text()))
    return 0
