"""The fleet discovery wants: static engines plus what the sources found (docs/behaviour.md "Engines that come and
go"). Pure.

Invariants:

* an engine is its URL: one URL is one engine whatever names or sources repeat it, and a
  static ``[[engines]]`` entry always wins over a discovered one with its URL;
* a name belongs to one URL: a discovered engine whose name is taken by another URL is refused
  (one line), never renamed behind the operator's back;
* engines already in the fleet keep their place: when the slots run out it is the newcomers
  that are refused, so a scale-up never pushes out an engine that is serving.

Why pure: the supervisor re-reads its sources every ``discovery.interval_s``, and what a change
does (who is added, who drains, who is refused) must be decided the same way every time and be
testable without a DNS server; reading the sources is :mod:`narwhal.supervisor.discovery.sources`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from narwhal.settings.engines import EngineSpec

STATIC = "static"
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


def engine_name(role: str, url: str) -> str:
    """``<role>-<host>-<port>``: the name of a discovered engine its source did not name."""
    parts = urlsplit(url)
    host = _NOT_IN_A_NAME.sub("-", parts.hostname or "")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{role}-{host}-{port}"[:64]


@dataclass(frozen=True, slots=True)
class Member:
    """One engine of the wanted fleet and the source it came from (``static``, ``file``, ``dns:NAME``)."""

    spec: EngineSpec
    source: str


@dataclass(slots=True)
class Wanted:
    """The fleet to run: members in a stable order, and the entries refused, one line each."""

    members: list[Member] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    refused_by_source: dict[str, int] = field(default_factory=dict)

    def urls(self) -> set[str]:
        """The URLs of the wanted members: what the running fleet is compared by."""
        return {m.spec.url for m in self.members}


def wanted_fleet(
    static: Sequence[EngineSpec],
    found: Mapping[str, Iterable[EngineSpec]],
    current: set[str],
    slots: int,
) -> Wanted:
    """Static engines, then each source's in its order (``found`` is ordered: the file, then
    each DNS name as configured); ``current`` is the URLs serving now, kept before newcomers."""
    out = Wanted(members=[Member(spec, STATIC) for spec in static])
    by_url = {spec.url: STATIC for spec in static}
    by_name = {spec.name: spec.url for spec in static}
    candidates = [(source, spec) for source, specs in found.items() for spec in specs]
    # Engines serving now first (stable sort): only newcomers can be refused for want of a slot.
    candidates.sort(key=lambda c: c[1].url not in current)
    for source, spec in candidates:
        if spec.url in by_url:
            continue  # the same engine, already in from a static entry or an earlier source
        owner = by_name.get(spec.name)
        if owner is not None:
            _refuse(out, source, f"discovery: {source}: engine {spec.name!r} at {spec.url} is refused: "
                                 f"the name is {owner}'s")
            continue
        if len(out.members) >= slots:
            _refuse(out, source, f"discovery: {source}: engine {spec.name!r} at {spec.url} is refused: "
                                 f"all {slots} engine slots are taken (discovery.max_engines)")
            continue
        out.members.append(Member(spec, source))
        by_url[spec.url] = source
        by_name[spec.name] = spec.url
    return out


def _refuse(out: Wanted, source: str, line: str) -> None:
    out.refused.append(line)
    out.refused_by_source[source] = out.refused_by_source.get(source, 0) + 1


@dataclass(frozen=True, slots=True)
class Change:
    """What moving from the fleet serving now to the wanted one means."""

    added: tuple[Member, ...]
    removed: tuple[str, ...]  # URLs: drained, then forgotten


def change(current: Iterable[str], wanted: Wanted) -> Change:
    """What moves from ``current`` (URLs) to ``wanted``: members to add, URLs to remove (sorted)."""
    now = set(current)
    return Change(
        added=tuple(m for m in wanted.members if m.spec.url not in now),
        removed=tuple(sorted(now - wanted.urls())),
    )
