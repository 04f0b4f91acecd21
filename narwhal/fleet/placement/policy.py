"""What a producer policy is (docs/behaviour.md "Placement"): one interface, whatever rule orders the producers.

A policy owns its data. The request path hands it the prompt once (:meth:`Policy.prepare`) and
carries what it returns, the *note*, unread: to placement (``Asked.note``), and, once a pair is
reserved, as the reservation's note (:meth:`Policy.placed` sets ``Reservation.note``); the
policy's hooks then see the reservation through its life (:meth:`Policy.prefilled`,
:meth:`Policy.released`), and the admin API asks it what it knows of an engine
(:meth:`Policy.describe`). What it needs beyond the request (the holdings, for ``held``) it is
given when it is built (:mod:`.registry`). The policies are :mod:`.least_loaded`,
:mod:`.affinity` and :mod:`.held`; a new one is its module and one line in :mod:`.registry`.

A policy orders the candidate producers of one placement and says why each is where it is (the
``producer_choice`` label of the access log).

Saturation is one rule applied once, before any policy (:func:`split_saturated`): a producer at
``placement.kv_saturated`` KV usage is tried only after every other, unless the policy keeps it
(``held`` keeps a saturated producer that holds the prompt's first block or is its home: a hit
shares the blocks); when every candidate is saturated the policy orders them all and the choice
is ``saturated``. The producers set aside are tried last, least loaded first
(``pair.Placement``, which asks the policy).

Invariants, and why:

* Pure: no I/O, no clock, no shared state but what it was built with; counts, readings, hashes
  and the randomness come in through :class:`Asked`, so a policy is judged offline
  (``perf.scarce_sim``) exactly as it runs.
* The request path has no branch for any policy and reads no note: it carries them.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from narwhal.fleet import Engine
from narwhal.fleet.placement.load import Loads
from narwhal.settings import PlacementSettings

if TYPE_CHECKING:
    from narwhal.fleet.placement.reservation import Reservation

Candidate = tuple[Engine, tuple[Engine, ...]]  # a producer and its permitted consumers
Choice = Callable[[int, Engine], str]  # (position in the order, producer) -> producer_choice


class PromptText(Protocol):
    """The prompt as a policy may read it: its text's first ``limit`` characters (None: the
    endpoint has none), and where its last answer sits in that text."""

    def __call__(self, limit: int) -> str | None:
        """The prompt text's first ``limit`` characters; None: the endpoint has no prompt text."""

    def answer_span(self, limit: int) -> tuple[int, int] | None:
        """The (start, end) characters of the last answer a later turn follows in the text of
        the same ``limit``; None: none (``Dialect.answer_span``)."""


def producer_index(candidate: Candidate) -> int:
    """The engine index of a candidate's producer (what per-engine figures are indexed by)."""
    return candidate[0].index


@dataclass(slots=True)
class Asked:
    """One placement's question to a policy: everything it may read, none of it shared."""

    load: Callable[[Candidate], Any]  # a candidate's prefill load (this host's legs, reported load)
    loads: Loads | None  # the engines' fresh readings; None when load reads are off
    note: Any  # what the policy's prepare kept of the request (None: nothing)
    hashes: Sequence[int]  # per engine index, its name's rendezvous hash
    rng: random.Random
    settings: PlacementSettings


@dataclass(slots=True)
class Ordered:
    """The producers in the order to try them, each one's label, and what the policy keeps of
    this ordering for :meth:`Policy.placed` (``held``: each position's facts; None: nothing)."""

    candidates: list[Candidate]
    choice: Choice
    kept: Any = None


class PrefillFacts(Protocol):
    """What a finished prefill says, as a policy's :meth:`Policy.prefilled` reads it
    (``engines.prefill_result.PrefillResult``)."""

    @property
    def descriptor(self) -> dict[str, Any] | None:
        """The producer's handoff descriptor (its ``remote_engine_id``); None: none."""
    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's tokens, as the producer counted them."""
    @property
    def cached_tokens(self) -> int | None:
        """Of them, the ones its prefix cache held."""
    @property
    def started_at(self) -> float:
        """When the prefill started (monotonic)."""
    @property
    def finished_at(self) -> float:
        """When it finished (monotonic)."""


class Placed(Protocol):
    """A reservation's note, as the request path may ask it (``Reservation.note``)."""

    @property
    def predicted_cached_chars(self) -> int | None:
        """The prompt's characters the chosen producer was believed to hold (the access log's field)."""
    @property
    def predicted_cached_tokens(self) -> int | None:
        """The cached tokens the chosen producer's KV-cache events predict (the access log's field; None: not known)."""


@dataclass(frozen=True, slots=True)
class PolicyRegion:
    """Shared memory a policy asks the master for (``Policy.region``), and the parts that use it
    in each process, named by ``module:attribute`` so that no process names the policy: the
    master calls ``create`` before any fork (the region, or None), each worker ``worker`` (its
    view, which the policy is built with as its ``holdings``), the supervisor ``supervisor`` (its
    part, ``narwhal.supervisor.policy_part.PolicyPart``). Like llm-d's plugin factories, the
    policy says what it runs where; the processes only build what it names."""

    keys: int  # block keys for the configured producers' sections together
    entry_keys: int  # block keys one prefill report carries at most
    create: str  # (need, settings, worker slots, engine slots) -> the region
    worker: str  # (region, engines, worker slot) -> the worker's view
    supervisor: str  # (region, settings, engines, followed KV events) -> the supervisor's part


def part(path: str) -> Any:
    """A policy part named ``module:attribute`` (:class:`PolicyRegion`), imported when first asked."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Policy(Protocol):
    """A producer policy: what it keeps of a request, the order it gives, and what it does as the
    reservation lives. Built by :mod:`.registry` as ``cls(settings, holdings)``."""

    name: str

    @staticmethod
    def region(settings: PlacementSettings) -> PolicyRegion | None:
        """The shared memory it needs (None: none), asked by the master before any fork."""

    def prepare(self, prompt: PromptText) -> Any:
        """What this policy keeps of the request (its note; None: nothing), read from the prompt
        text once; never read by the request path."""

    def wants_tokens(self, note: Any) -> bool:
        """Would the prompt's token ids change the order it gives for the request ``note`` was
        kept of? The request path then asks an engine for them, once per request (``request.prompt_tokens``)."""

    def tokens(self, note: Any, ids: Sequence[int]) -> None:
        """The prompt's token ids as the engines tokenize it, for the request ``note`` was kept of."""

    def holders(self, note: Any, consumers: Sequence[Engine], share: float) -> list[Engine]:
        """The consumers of ``consumers`` that already hold at least ``share`` of the prompt's
        blocks, most first, to decode it alone (none: P/D as usual)."""

    def keeps_saturated(self, asked: Asked) -> Callable[[Candidate], bool] | None:
        """Which saturated candidates stay among the others (None: none do)."""

    def order(self, candidates: list[Candidate], asked: Asked) -> Ordered:
        """``candidates`` (none set aside for saturation) in the order to try them."""

    def placed(self, resv: Reservation, note: Any, ordered: Ordered, position: int) -> None:
        """The pair at ``position`` of ``ordered`` is reserved for the request ``note`` was kept
        of (``ordered`` came from another note on the fallback's pass, which orders by rank):
        the reservation's note set (``Reservation.note``: a :class:`Placed`, or None)."""

    def prefilled(self, resv: Reservation, result: PrefillFacts) -> None:
        """The reservation's prefill finished (called off the client's critical path, and only
        for a reservation with a note)."""

    def released(self, resv: Reservation) -> None:
        """The reservation's prefill slot was given back (only for one with a note)."""

    def decoded(self, resv: Reservation, at: float) -> None:
        """The reservation's decode completed at ``at`` (monotonic): its consumer now holds the
        prompt (only for one with a note)."""

    def describe(self, engine: Engine) -> dict[str, Any] | None:
        """What the policy knows of ``engine``, for the admin API (None: nothing)."""


class KeepsNothing:
    """The hooks of a policy that keeps nothing past the order it gives: no reservation note, no
    shared memory."""

    @staticmethod
    def region(settings: PlacementSettings) -> PolicyRegion | None:
        """No shared memory."""
        return None

    def wants_tokens(self, note: Any) -> bool:
        """Token ids change nothing."""
        return False

    def tokens(self, note: Any, ids: Sequence[int]) -> None:
        """Never called: token ids are never wanted."""

    def holders(self, note: Any, consumers: Sequence[Engine], share: float) -> list[Engine]:
        """No consumer's holdings are known."""
        return []

    def placed(self, resv: Reservation, note: Any, ordered: Ordered, position: int) -> None:
        """Nothing kept: the reservation's note stays None."""

    def prefilled(self, resv: Reservation, result: PrefillFacts) -> None:
        """Never called: no reservation of this policy has a note."""

    def released(self, resv: Reservation) -> None:
        """Never called: no reservation of this policy has a note."""

    def decoded(self, resv: Reservation, at: float) -> None:
        """Never called: no reservation of this policy has a note."""

    def describe(self, engine: Engine) -> dict[str, Any] | None:
        """Nothing known of an engine beyond what placement reads of every engine."""
        return None


def split_saturated(
    candidates: list[Candidate], loads: Loads | None, keeps: Callable[[Candidate], bool] | None,
) -> tuple[list[Candidate], list[Candidate], bool]:
    """(the candidates the policy orders, those tried last, whether every one is saturated)."""
    if loads is None or not loads.any_saturated or not candidates:
        return candidates, [], False
    full = loads.saturated
    if all(full[c[0].index] for c in candidates):
        return candidates, [], True
    front: list[Candidate] = []
    rest: list[Candidate] = []
    for c in candidates:
        (rest if full[c[0].index] and (keeps is None or not keeps(c)) else front).append(c)
    return front, rest, False


def saturated(position: int, producer: Engine) -> str:
    """Every candidate was saturated: saturation told them apart no more."""
    return "saturated"


def by_load(position: int, producer: Engine) -> str:
    """Chosen by load alone."""
    return "least_loaded"


def by_affinity(position: int, producer: Engine) -> str:
    """The key's favourite (a lone candidate is)."""
    return "affinity"
