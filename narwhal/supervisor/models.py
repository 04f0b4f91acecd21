"""Model discovery, run by the supervisor alone: each engine's ``/v1/models``, into shared memory.

docs/behaviour.md "The request path": which engine serves which model is read from its
``/v1/models`` at start and at every readmission (``engines[].models``, when set, is taken as it is
and never read). The supervisor reads; the workers only read the result (``shm.models``, followed by
``worker.models_follow``): one reader per host instead of one per worker, and every worker sees the
same models.

An engine is read:

* at the supervisor's start (a restarted supervisor first takes what its predecessor published,
  so nothing flaps while it reads again);
* when it is readmitted — out (ejected, probing, draining) and then serving again — so an
  engine restarted with another model is seen as it comes back; and when it joins at run time
  (discovery, docs/behaviour.md "Engines that come and go"), as its first probe starts;
* every :data:`RETRY_S` while it never answered (an engine down at start is picked up as it
  comes), and every engine every :data:`REFRESH_S`: a model swap that no readmission saw (an
  engine restarted between two health checks) still shows.

Invariants, and why:

* The loop never waits: reads are tasks, one per engine at most, each bounded by
  :data:`~narwhal.shm.models.READ_TIMEOUT_S`, started from the loop's pass (``tick``), which only compares, and
  started a batch at a time (``supervisor.rounds``), so a large fleet's round delays no beat.
* An engine that stops answering keeps the models it last answered with: whether it takes
  requests is its breaker's call, not this module's. One that never answered serves none.
* Decisions out, effects at the loop: :meth:`ModelReader.tick` returns what the reads changed
  (:class:`ModelsRead`: an engine's models or version for the fleet) and, when anything did, the
  records to publish (:class:`ModelsPublished`). The reader never touches the fleet or shared
  memory; the supervisor's loop applies both (``Supervisor.apply_models``), so the loop is the
  one writer of every record and a test drives the reader with no supervisor at all.
* A round is published only when something changed, at most once per pass of the loop (a
  round's answers come together): every engine's record is rewritten under the next models
  generation, then the generation is bumped (``shm.models``: workers wait for
  the records to carry it). A bound that bites (a name too long, too many names) is logged
  once per change of the answer, never per read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from narwhal.engines.control import (
    SCALE_OUT_REFUSAL,
    ControlClient,
    ControlError,
    EngineRef,
    parse_model_card,
    parse_models,
    parse_version,
)
from narwhal.fleet import Engine, Fleet
from narwhal.settings import EngineSettings
from narwhal.shm import models as M
from narwhal.shm.table import record_hash
from narwhal.supervisor.breaker import EngineStatus, State
from narwhal.supervisor.rounds import Rounds

log = logging.getLogger("narwhal.supervisor.models")

RETRY_S = 1.0
REFRESH_S = 30.0
SPREAD_S = 0.25  # a round's reads start over this (a batch per pass of the loop), the first at the next pass
_OUT = frozenset({State.EJECTED, State.PROBING, State.DRAINING})

Known = tuple[int, int, tuple[str, ...]]  # identity hash, status (shm.models), models


class ControlGet(Protocol):
    """What the reader asks of an engine (``engines.control.ControlClient``; a fake in the tests)."""

    async def get(self, engine: EngineRef, path: str) -> tuple[int, bytes]:
        """``path``'s status and body, or ``ControlError``."""
        ...

    async def generate_refused(self, engine: EngineRef) -> bool | None:
        """Whether ``/inference/v1/generate`` answers 403 (None: no answer)."""
        ...


class BreakerStates(Protocol):
    """What the reader reads of the breakers: whether an engine is out, and whether any moved."""

    @property
    def version(self) -> int:
        """Moves with every change of any engine's state."""
        ...

    def status(self, name: str) -> EngineStatus:
        """``name``'s status now."""
        ...


@dataclass(frozen=True, slots=True)
class ModelsRead:
    """What reads changed of one engine, for the fleet: its models, or its vLLM version."""

    engine: Engine
    models: frozenset[str] | None = None  # the models it serves now; None: as they were
    version_moved: bool = False  # its version is news: ``version`` (None: unknown again)
    version: str | None = None


@dataclass(frozen=True, slots=True)
class ModelsPublished:
    """Every engine's record, to be written under the next models generation, then the bump."""

    records: tuple[tuple[Engine, M.ModelsRecord], ...]  # each record's ``version`` is set as it is written


Decision = ModelsRead | ModelsPublished


class ModelReader:
    """Reads the engines' ``/v1/models`` and says what changed; the supervisor's loop calls :meth:`tick`."""

    def __init__(self, control: ControlGet, rounds: Rounds, pace_s: float) -> None:
        self.control = control
        self.rounds = rounds  # the loop's batches: the reads start a batch per pass
        self.pace_s = pace_s  # at most a round of reads per engine per this (recovery.health_interval_s)
        self.session: aiohttp.ClientSession | None = None  # closed: the supervisor stopped, no read starts
        self._known: dict[str, Known] = {}  # by engine name: what was last published for it
        # by engine name: its /version as last read (docs/decisions.md "vLLM releases")
        self._versions: dict[str, str] = {}
        self._generate: dict[str, int] = {}  # by engine name: M.GENERATE_SERVED or _REFUSED, as last read
        # by engine name: (max_model_len, first model's root) from its /v1/models, as last read
        self._cards: dict[str, tuple[int | None, str | None]] = {}
        self._recheck: set[str] = set()  # answering again after refusing: its /version read again
        self._round_at: dict[str, float] = {}  # by engine name: when its last round of reads started
        self._held: set[str] = set()  # wanted, but their last round is too recent: read when it allows
        self._reading: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._done: list[tuple[Engine, str | None, bool | None, list[str] | None]] = []  # reads ended since
        self._news: list[ModelsRead] = []  # what settling them changed, for the fleet
        self._changed = False  # an answer changed something: publish at the next pass
        self._out: dict[str, bool] = {}  # by engine name: out at the last look (readmission = out, then not)
        self._breakers_seen = -1
        self._engines_seen: list[Engine] | None = None
        self._next_refresh = 0.0  # due at the first tick: the supervisor's start
        self._next_retry = 0.0

    @classmethod
    def over(cls, session: aiohttp.ClientSession, engine: EngineSettings, rounds: Rounds,
             pace_s: float) -> ModelReader:
        """A reader through ``session`` (the supervisor's: TLS and the engine key, ``engines.control``)."""
        reader = cls(ControlClient(session, engine, M.READ_TIMEOUT_S), rounds, pace_s)
        reader.session = session
        return reader

    def _stopped(self) -> bool:
        return self.session is not None and self.session.closed

    def restore(self, published: Iterable[tuple[Engine, M.ModelsRecord]]) -> list[ModelsRead]:
        """Take what a previous supervisor published for the engines still known (none at first
        start: ``published`` holds the whole records whose identity is the engine's); returns what
        the fleet is to take up of it."""
        taken = []
        for engine, rec in published:
            models = None
            if rec.status in (M.ANSWERED, M.UNANSWERED):
                self._known[engine.name] = (rec.name_hash, rec.status, rec.models)
                models = frozenset(rec.models)
            if rec.engine_version is not None:
                self._versions[engine.name] = rec.engine_version
            if rec.generate != M.GENERATE_UNKNOWN:
                self._generate[engine.name] = rec.generate
            if rec.max_model_len or rec.root:
                self._cards[engine.name] = (rec.max_model_len, rec.root)
            if models is not None or rec.engine_version is not None:
                taken.append(ModelsRead(engine, models, rec.engine_version is not None, rec.engine_version))
        return taken

    def tick(self, now: float, fleet: Fleet, breakers: BreakerStates) -> list[Decision]:
        """The reads ended since settled, what changed returned (and published once any did); then
        the reads due now started, never awaited."""
        engines = fleet.engines
        for engine, version, refused, answer in self._done:
            if fleet.by_name.get(engine.name) is engine:  # not forgotten or replaced meanwhile
                self.settle_version(engine, version)
                self.settle_generate(engine, refused)
                if not engine.models_configured:
                    self.settle(engine, answer)
        self._done.clear()
        due = back = self._readmitted(engines, breakers)
        if engines is not self._engines_seen:  # the start, or engines joined or left (discovery)
            self._engines_seen = engines
            idents = {e.name: record_hash(e.name, e.url) for e in engines}
            self._known = {n: k for n, k in self._known.items() if idents.get(n) == k[0]}
            self._versions = {n: v for n, v in self._versions.items() if n in idents}
            self._generate = {n: g for n, g in self._generate.items() if n in idents}
            due += [e for e in engines if e.name not in self._known or e.name not in self._versions]
            self._changed = True
        if now >= self._next_refresh:
            self._next_refresh = now + REFRESH_S
            self._next_retry = now + RETRY_S
            due = list(engines)
        elif now >= self._next_retry:
            self._next_retry = now + RETRY_S
            due += [e for e in engines if self._known.get(e.name, (0, M.PENDING))[1] != M.ANSWERED
                    or e.name not in self._versions]
        decisions: list[Decision] = list(self._news)
        self._news.clear()
        if self._changed:
            self._changed = False
            decisions.append(self.records(engines))
        self._start_due(now, engines, due, {e.name for e in back})
        return decisions

    def _start_due(self, now: float, engines: list[Engine], due: list[Engine], back: set[str]) -> None:
        # Answering again after refusing, or wanted at an earlier pass its pace held back.
        due += [e for e in engines if e.name in self._recheck or e.name in self._held]
        # At most one round per engine per health_interval_s (docs/behaviour.md), except for an
        # engine that just became reachable or was readmitted (``back``, ``_recheck``): read at
        # once, so it takes traffic as soon as it is admitted, not a health interval later.
        pace = self.pace_s
        wanted = [e for e in dict.fromkeys(due) if e.name not in self._reading
                  and not (e.models_configured and e.name in self._versions and e.name not in self._recheck)]
        due = [e for e in wanted if e.name in back or e.name in self._recheck
               or now - self._round_at.get(e.name, -pace) >= pace]
        self._held = {e.name for e in wanted} - {e.name for e in due}
        if due:
            self._reading.update(e.name for e in due)
            self._round_at.update((e.name, now) for e in due)
            self.rounds.spread([functools.partial(self._start, e) for e in due], SPREAD_S)

    def _start(self, engine: Engine) -> None:
        if self._stopped():  # a round still being spread when the supervisor stopped
            self._reading.discard(engine.name)
            return
        self._track(self._read(engine))

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _readmitted(self, engines: list[Engine], breakers: BreakerStates) -> list[Engine]:
        """Engines serving again after being out since the last look (only when a breaker moved)."""
        if breakers.version == self._breakers_seen:
            return []
        self._breakers_seen = breakers.version
        back = []
        for engine in engines:
            out = breakers.status(engine.name).state in _OUT
            if self._out.get(engine.name) and not out:
                back.append(engine)
            self._out[engine.name] = out
        return back

    async def _read(self, engine: Engine) -> None:
        """One engine's reads, kept for the next pass to settle (the loop's, never the task's)."""
        version: str | None = None
        refused: bool | None = None
        try:
            version = await self._version(engine)
            answer = None if engine.models_configured else await self._answer(engine)
            # Asked once per engine process, not per read: vLLM logs each question as a 400 on
            # its generate route. Again when the version moved or the engine came back (a new
            # process may run with or without --enable-scale-out).
            name = engine.name
            moved = version is not None and version != self._versions.get(name)  # no answer: nothing moved
            if name not in self._generate or name in self._recheck or moved:
                refused = await self.control.generate_refused(engine)
        except Exception:  # a read must never take the supervisor down
            if self._stopped():
                return  # the session closed under it: the supervisor is stopping
            log.exception("reading the models of %s crashed", engine.name)
            answer = None
        finally:
            self._reading.discard(engine.name)
        self._done.append((engine, version, refused, answer))

    async def _version(self, engine: Engine) -> str | None:
        try:
            status, body = await self.control.get(engine, "/version")
        except ControlError:
            return None
        return M.fit_version(parse_version(body)) if status == 200 else None

    def reread(self, engine: Engine) -> None:
        """Read ``engine``'s ``/version`` and models again (it answers again after refusing
        connections: maybe a new process), at the next pass its pace allows (``tick``)."""
        self._recheck.add(engine.name)

    def settle_version(self, engine: Engine, version: str | None) -> None:
        """One read's ``/version`` (None: no usable answer); a change is published. A routine
        read without one leaves the last version standing (a busy engine); a read after the
        engine refused connections leaves it unknown: a new process's release is not its old one
        (docs/behaviour.md: unknown, not unreachable)."""
        if engine.name in self._recheck:
            self._recheck.discard(engine.name)
            if version is None and self._versions.pop(engine.name, None) is not None:
                self._changed = True
                self._news.append(ModelsRead(engine, version_moved=True, version=None))
                log.warning("engine %s answers again but not its /version: its vLLM version is unknown", engine.name)
        if version is None or self._versions.get(engine.name) == version:
            return
        self._versions[engine.name] = version
        self._changed = True
        self._news.append(ModelsRead(engine, version_moved=True, version=version))

    def settle_generate(self, engine: Engine, refused: bool | None) -> None:
        """Whether ``engine`` answered 403 on ``/inference/v1/generate`` (None: no answer: the last
        word stands); a change is published and logged once (docs/decisions.md "vLLM releases")."""
        if refused is None:
            return
        state = M.GENERATE_REFUSED if refused else M.GENERATE_SERVED
        if self._generate.get(engine.name) == state:
            return
        if refused:
            log.warning("engine %s %s: requests there fail with its 403", engine.name, SCALE_OUT_REFUSAL)
        self._generate[engine.name] = state
        self._changed = True

    async def _answer(self, engine: Engine) -> list[str] | None:
        try:
            status, body = await self.control.get(engine, "/v1/models")
        except ControlError:
            return None
        if status != 200:
            return None
        card = parse_model_card(body)
        if self._cards.get(engine.name) != card:
            self._cards[engine.name] = card
            self._changed = True
        return parse_models(body)

    def settle(self, engine: Engine, answer: list[str] | None) -> None:
        """Take one read's answer (None: no answer, or not a model list); what changed goes out at the next pass."""
        ident = record_hash(engine.name, engine.url)
        old = self._known.get(engine.name)
        if answer is None:
            if old is not None:
                return  # it keeps what it last answered with, or stays unanswered
            log.warning("engine %s: no model list from its /v1/models: it serves no model until it answers",
                        engine.name)
            new: Known = (ident, M.UNANSWERED, ())
        else:
            fitted = M.fit(answer)
            new = (ident, M.ANSWERED, fitted.models)
            if new != old:
                refusal = fitted.refusal(engine.name)
                if refusal is not None:
                    log.warning("%s", refusal)
        if new != old:
            self._known[engine.name] = new
            self._changed = True
            self._news.append(ModelsRead(engine, models=frozenset(new[2])))  # probes' fallback model too

    def records(self, engines: list[Engine]) -> ModelsPublished:
        """Every engine's record as the reader knows it (``shm.models``), its generation set as it is written."""
        out = []
        for engine in engines:
            ident = record_hash(engine.name, engine.url)
            models: tuple[str, ...] = ()
            if engine.models_configured:
                status = M.CONFIGURED  # workers take engines[].models from their own settings
            else:
                _, status, models = self._known.get(engine.name, (ident, M.PENDING, ()))
            context, root = self._cards.get(engine.name, (None, None))
            out.append((engine, M.ModelsRecord(0, ident, status, models, self._versions.get(engine.name),
                                               self._generate.get(engine.name, M.GENERATE_UNKNOWN), context, root)))
        return ModelsPublished(tuple(out))
