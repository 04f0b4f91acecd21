"""What the ``held`` policy reads of each producer's holdings: the interface, not the policy.

The holdings themselves live in shared memory (``narwhal.shm.holdings``, written by the
supervisor); the ``held`` policy reads them, and reports its finished prefills, through these two
protocols. They have a module of their own so that the holdings' side of shared memory
(``shm.holdings_view``) and the tests' sources name them without importing the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class HeldReading(Protocol):
    """One producer's published holdings (``narwhal.shm.holdings.Held``)."""

    @property
    def keys(self) -> frozenset[int]:
        """The block keys the producer is believed to hold."""
    @property
    def blocks(self) -> int:
        """How many blocks that is."""
    @property
    def capacity_blocks(self) -> int | None:
        """Its KV capacity in blocks of ``block_chars`` (reported, else learned from its evictions); None: unknown."""
    @property
    def chars_per_token(self) -> float | None:
        """Characters per token its prefills showed; None before any."""
    @property
    def prefill_chars_per_s(self) -> float | None:
        """Its prefill rate to place by (uncached characters per second); None before any."""
    @property
    def mean_uncached_chars(self) -> float:
        """The mean uncached characters of its prefills: the work a request not ours stands for."""
    @property
    def hot_blocks(self) -> int:
        """Blocks reused in the last few seconds: the live part of ``blocks``."""
    @property
    def homes(self) -> dict[int, int] | None:
        """The live prefixes homed here, first block key to blocks; None for none."""
    @property
    def token_keys(self) -> frozenset[int]:
        """The token block keys its KV-cache events say it holds (``token_blocks``)."""
    @property
    def report_full(self) -> bool:
        """Its events are newly followed: its prefills ask it to re-announce the blocks they reuse."""
    @property
    def block_tokens(self) -> int:
        """Tokens per block of ``token_keys``; 0: its events are not followed (``FOLLOWED_EMPTY``:
        followed, nothing stored yet)."""


class HoldingsSource(Protocol):
    """Per engine index, the holdings published for it (None: none), and this host's prefill
    work in flight (uncached characters of its prefill legs), which placement adds to and takes
    back as legs start and end; and where finished prefills go."""

    def current(self) -> Sequence[HeldReading | None]:
        """Per engine index, its published holdings (None: none)."""
    def work(self) -> Sequence[int]:
        """Per engine index, this host's uncached prefill characters in flight on it."""
    def add_work(self, engine: int, chars: int) -> None:
        """Add ``chars`` (negative: take back) to ``engine``'s work in flight."""
    def report_prefill(
        self, producer: int, engine_id: str | None, prompt_chars: int, prompt_tokens: int | None,
        cached_tokens: int | None, duration_s: float, keys: list[int], queued_chars: int = 0, at: float = 0.0,
    ) -> None:
        """Record one completed prefill (what it cached, how long it took) for the supervisor; never awaits."""
