"""The engines a router knows, what they serve, and which producer→consumer pairs are permitted.

This is static configuration plus discovered models. *Whether an engine is admitted right
now* is not stored here: it is asked of a :class:`FleetView`, the single seam through which
placement learns breaker state: the supervisor's shared-memory view in a gunicorn worker
(:class:`narwhal.shm.worker.WorkerFleetState`), a process-local one elsewhere
(:class:`narwhal.shm.local.LocalFleetState`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from narwhal.settings import Settings
from narwhal.settings.engines import EngineSpec

log = logging.getLogger("narwhal.fleet.roster")


@dataclass(slots=True, eq=False)
class Engine:
    """One configured or discovered engine, with the pairs it may form; compared by identity, never by value."""

    index: int
    name: str
    url: str
    role: str
    can_prefill: bool  # decided by EngineSpec (settings), the one place roles are read
    can_decode: bool
    connector: str
    wave: str | None
    max_inflight_prefill: int | None
    max_inflight_decode: int | None
    peers: frozenset[str] | None  # the consumers a producer may hand off to; None: any
    models: frozenset[str] = frozenset()
    models_configured: bool = False
    transfer_mode: str = "pull"  # engines[].transfer_mode: NIXL pull or push (docs/decisions.md "vLLM releases")
    version: str | None = None  # the engine's /version as the supervisor read it; None: not yet
    enforce_versions: bool = True  # compat.enforce_versions: pairs need one vLLM version
    generate_refused: bool = False  # it answers 403 on /inference/v1/generate (no --enable-scale-out)
    max_model_len: int | None = None  # its context length, as its /v1/models said; None: not said
    model_root: tuple[str, str] | None = None  # (its first model, that model's root), as /v1/models said
    models_read: bool = False  # a worker holds the supervisor's first read of its models (worker.models_follow)
    permitted_consumers: tuple[Engine, ...] = ()
    permitted_producers: tuple[Engine, ...] = field(default=())


def pair_permitted(p: Engine, d: Engine) -> bool:
    """docs/behaviour.md "Placement": roles, kv_peers, same connector; P = D only for role ``both``."""
    if not (p.can_prefill and d.can_decode) or p.connector != d.connector:
        return False
    if p is d:
        return p.role == "both"
    return p.peers is None or d.name in p.peers


class Fleet:
    """The engines, each at its ``index``: its position in ``[[engines]]`` for a static fleet, its
    engine slot for one that changes at run time (:meth:`indexed`, :meth:`replace`), so an
    engine keeps its index for as long as a process knows it and lists by index stay right."""

    def __init__(self, settings: Settings, members: list[tuple[int, EngineSpec]] | None = None) -> None:
        self._connector_of = settings.connector_of
        self._enforce_versions = settings.compat.enforce_versions
        if members is None:
            members = list(enumerate(settings.engines))
        self.engines: list[Engine] = []
        self.by_name: dict[str, Engine] = {}
        self._served: frozenset[str] = frozenset()
        self._contexts: dict[str, int | None] = {}  # model -> its smallest max_model_len (context)
        self.version = 0  # bumped whenever an engine's models change, or the engines (placement caches by it)
        self.replace(members)

    @property
    def span(self) -> int:
        """One past the highest index: the length of a list by index."""
        return max((e.index for e in self.engines), default=-1) + 1

    def by_index(self, value: Callable[[Engine], Any]) -> list[Any]:
        """``value`` of every engine in a list by ``Engine.index`` (an index is not a position)."""
        out: list[Any] = [0] * self.span
        for e in self.engines:
            out[e.index] = value(e)
        return out

    def replace(self, members: list[tuple[int, EngineSpec]]) -> tuple[list[Engine], list[Engine]]:
        """The engines become ``members`` (index, entry): an engine whose index, name, URL and
        entry are unchanged is kept (the same object, its discovered models with it); the rest
        are new. Returns (added, removed)."""
        old = {e.index: e for e in self.engines}
        engines: list[Engine] = []
        added: list[Engine] = []
        for index, spec in sorted(members, key=lambda m: m[0]):
            fresh = _engine(index, spec, self._connector_of(spec), self._enforce_versions)
            kept = old.pop(index, None)
            if kept is not None and _same(kept, fresh):
                engines.append(kept)
                continue
            if kept is not None:
                old[-1 - index] = kept  # replaced at its index: reported as removed
            engines.append(fresh)
            added.append(fresh)
        self.engines = engines
        self.by_name = {e.name: e for e in engines}
        for p in engines:
            p.permitted_consumers = tuple(d for d in engines if pair_permitted(p, d))
        for d in engines:
            d.permitted_producers = tuple(p for p in engines if d in p.permitted_consumers)
        self._refresh_served()
        return added, list(old.values())

    def set_models(self, engine: Engine, models: frozenset[str], *, say: bool = True) -> None:
        """The models ``engine`` serves (from ``/v1/models``); placement's caches move with ``version``.
        ``say``: log the change (the supervisor does; a worker following its records does not, or
        the line would repeat once per process)."""
        if engine.models != models and say:
            log.info("engine %s serves %s", engine.name, sorted(models))
        engine.models = models
        self._refresh_served()

    def set_version(self, engine: Engine, version: str | None, *, say: bool = True) -> None:
        """The vLLM version ``engine`` reports (``/version``); placement's pairs move with ``version``
        (docs/decisions.md "vLLM releases": only engines of one version hand off). ``say``: as
        :meth:`set_models`."""
        if engine.version != version:
            if version is not None and say:
                log.info("engine %s runs vLLM %s", engine.name, version)
            engine.version = version
            self.version += 1

    def set_context(self, engine: Engine, max_model_len: int | None) -> None:
        """The context length ``engine``'s ``/v1/models`` reports (None: not said)."""
        if engine.max_model_len != max_model_len:
            engine.max_model_len = max_model_len
            self._contexts = {}

    def context(self, model: str) -> int | None:
        """The smallest ``max_model_len`` among the engines serving ``model`` (a request that fits
        it fits any), None when none said; cached until an engine's models or length move."""
        contexts = self._contexts
        if model in contexts:
            return contexts[model]
        lengths = [e.max_model_len for e in self.engines if model in e.models and e.max_model_len]
        context = contexts[model] = min(lengths) if lengths else None
        return context

    def _refresh_served(self) -> None:
        self.version += 1
        self._served = frozenset(m for e in self.engines for m in e.models)
        self._contexts = {}

    @property
    def served_models(self) -> frozenset[str]:
        """Every model some engine serves: what ``/v1/models`` lists and admission accepts."""
        return self._served

    def serves(self, model: str) -> bool:
        """Does some engine serve ``model``? One set lookup."""
        return model in self._served


def _same(a: Engine, b: Engine) -> bool:
    """The same engine, described the same (models discovered at run time aside)."""
    return _description(a) == _description(b)


def _description(e: Engine) -> tuple[Any, ...]:
    """What a reload compares: the engine's configured description, not what was discovered at run time."""
    return (e.name, e.url, e.role, e.connector, e.wave, e.max_inflight_prefill, e.max_inflight_decode, e.peers,
            e.models_configured, e.models if e.models_configured else None, e.transfer_mode)


def _engine(index: int, spec: EngineSpec, connector: str, enforce_versions: bool = True) -> Engine:
    return Engine(
        index=index,
        name=spec.name,
        url=spec.url,
        role=spec.role,
        can_prefill=spec.can_prefill,
        can_decode=spec.can_decode,
        connector=connector,
        wave=spec.wave,
        max_inflight_prefill=spec.max_inflight_prefill,
        max_inflight_decode=spec.max_inflight_decode,
        peers=frozenset(spec.kv_peers) if spec.kv_peers is not None else None,
        models=frozenset(spec.models or ()),
        models_configured=spec.models is not None,
        transfer_mode=spec.transfer_mode,
        enforce_versions=enforce_versions,
    )


class FleetView(Protocol):
    """What placement asks about breaker state: the one seam the supervisor fills in.

    Two kinds of "not now" (docs/behaviour.md "Recovery"). *Out* — ejected, probing, draining, taken out by an
    operator — is hard: such an engine takes no new request. *Quarantined* — the supervisor's
    published QUARANTINED state or this worker's own quarantine after a failure it saw — is
    soft: placement steers around it while other engines can take the request, and uses it
    when none can, since a fault that follows requests quarantines every engine in turn.
    *Unreachable* (its last connection attempt failed) is a third, independent fact: such an
    engine is avoided like a quarantined one and comes last when placement falls back.
    """

    def admitted(self, engine: Engine) -> bool:
        """Neither out nor quarantined: what the normal (hot) placement path asks."""
        ...

    def placeable(self, engine: Engine) -> bool:
        """Not out; quarantined or not."""
        ...

    def any_avoided(self) -> bool:
        """Might some engine be quarantined or unreachable now? Cheap; False means :meth:`admitted`
        and :meth:`placeable` agree on every engine (a stale True only costs a second look)."""
        ...

    def quarantine_left(self, engine: Engine) -> float:
        """Seconds until the engine's quarantine ends (the later of the local and the
        published one); 0.0 when it is not quarantined."""
        ...

    def unreachable(self, engine: Engine) -> bool:
        """Did the engine's last connection attempt fail (docs/behaviour.md "Recovery", round 4)? Published by the
        supervisor, or seen by this worker a moment ago."""
        ...

    def ejected_by_breaker(self, engine: Engine) -> bool:
        """Out because its breaker ejected it (not by an operator, not draining): a last resort
        when every placeable engine of its role is unreachable (``fleet.placement.fallback``)."""
        ...

    def why_out(self, engine: Engine) -> str:
        """Why a not placeable engine is out, in a word or two (``ejected``, ``ejected by the
        operator``, ``probing``, ``draining``, ``joining``): what a 503 and ``/ready`` name."""
        ...
