"""One publisher's KV events as the subscriber holds them: the sequence and the exact block set.

vLLM numbers each publisher's batches from 0 and keeps the last ``buffer_steps`` for replay; a
restarted engine numbers from 0 again, with no incarnation on the wire. So, per publisher:

- the next batch is applied when its ``seq`` is the one expected;
- a ``seq`` past it is a **gap**: the batches between are asked of the replay socket first;
- the last batch again, byte for byte, is a **duplicate** (ignored); any other ``seq`` below the
  expected one is a **restart**: the engine's cache is new, what was known of it is dropped;
- a replay that does not start at the batch asked for (vLLM replays silently from the oldest it
  kept) or is not contiguous cannot fill the gap: what was known is dropped too (a **reset**),
  and the stream goes on from what the replay did bring.

``blocks`` maps each cached block's hash to its parent's (None: the chain starts at token 0), as
``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` say; ``keys`` each block's key in
Narwhal's own chain over its token ids (``fleet.placement.token_blocks``: what a prompt's token
blocks are compared with), in the order they were stored, most recent last. A block whose
parent is not known (stored before the subscription began) has no key: its place in a prompt
cannot be known. ``changes`` moves with every batch that stored or removed a block.

Invariant: pure (no I/O, no clock); ``blocks`` is exactly what the applied batches say, and is
emptied by every reset: never a picture spliced across a gap or a restart.
"""

from __future__ import annotations

from collections.abc import Iterable

from narwhal.fleet.placement.token_blocks import Unkeyable, as_key, digest
from narwhal.supervisor.kv_events.decode import Cleared, Event, Removed, Stored

APPLIED, DUPLICATE, GAP, RESTART = "applied", "duplicate", "gap", "restart"


class Stream:
    """One publisher's sequence and blocks (the module's text)."""

    __slots__ = ("next_seq", "blocks", "keys", "block_size", "changes", "report_until", "_last", "resets", "cleared")

    def __init__(self) -> None:
        self.next_seq: int | None = None  # None: nothing applied yet
        self.blocks: dict[int | bytes, int | bytes | None] = {}
        self.keys: dict[int | bytes, int] = {}  # engine hash -> our key of the block (token_blocks)
        self.block_size = 0  # tokens per block, as the last BlockStored said (0: none yet)
        self.changes = 0
        # Until when (the follower's clock) prefills ask the engine to re-announce the blocks they
        # reuse: what it cached before the subscription began is learned so (the hub sets it).
        self.report_until = 0.0
        self._last = b""  # the last applied payload: what a duplicate repeats
        self.resets = 0
        self.cleared = False  # an AllBlocksCleared was applied since the caller last looked

    @property
    def in_sync(self) -> bool:
        """A contiguous run of batches is applied: the block set is the engine's own account."""
        return self.next_seq is not None

    def live(self, seq: int, payload: bytes, events: list[Event]) -> str:
        """A batch from the PUB socket: :data:`APPLIED`, :data:`DUPLICATE`, :data:`GAP` (replay
        from ``next_seq`` first, or from 0 when nothing was applied) or :data:`RESTART`."""
        expected = self.next_seq
        if expected is None:
            if seq != 0:
                return GAP  # a late joiner: what it missed is asked of the replay first
            self._apply(seq, payload, events)
            return APPLIED
        if seq == expected:
            self._apply(seq, payload, events)
            return APPLIED
        if seq > expected:
            return GAP
        if seq == expected - 1 and payload == self._last:
            return DUPLICATE
        self.reset()
        if seq == 0:
            self._apply(seq, payload, events)
        return RESTART

    def replayed(self, asked: int, until: int, batches: Iterable[tuple[int, bytes, list[Event]]]) -> bool:
        """The replay's batches for the gap ``[asked, until)``; False when it could not fill it
        (the module's text): the blocks were reset, and the batches it brought applied."""
        filled = True
        expected = asked
        for seq, payload, events in batches:
            if seq < expected:
                continue  # a batch the replay sent twice
            if seq != expected and filled:
                self.reset()
                filled = False
            self._apply(seq, payload, events)
            expected = seq + 1
        if filled and expected < until:  # the replay ended before the gap did
            self.reset()
            filled = False
        return filled

    def accept(self, seq: int, payload: bytes, events: list[Event]) -> None:
        """Start afresh at this batch (a late joiner whose replay could not reach back, or a
        restart first seen past its 0): what it knows from here on is exact, what came before is
        not known (never stale)."""
        self.reset()
        self._apply(seq, payload, events)

    def reset(self) -> None:
        """Forget every block and the sequence: the engine's cache is not what was known."""
        self.blocks.clear()
        self.keys.clear()
        self.changes += 1
        self.next_seq = None
        self._last = b""
        self.resets += 1

    def _apply(self, seq: int, payload: bytes, events: list[Event]) -> None:
        blocks, keys = self.blocks, self.keys
        for event in events:
            if isinstance(event, Stored):
                parent = event.parent
                size = event.block_size
                known = None if parent is None else keys.get(parent)
                keyable = parent is None or known is not None
                previous = None if known is None else known.to_bytes(8, "little")
                self.block_size = size
                for i, h in enumerate(event.hashes):
                    blocks[h] = parent
                    keys.pop(h, None)  # stored again: the most recent now
                    if keyable:
                        try:
                            previous = digest(previous, event.tokens[i * size : (i + 1) * size])
                        except Unkeyable:
                            keyable = False
                        else:
                            keys[h] = as_key(previous)
                    parent = h
            elif isinstance(event, Removed):
                for h in event.hashes:
                    blocks.pop(h, None)
                    keys.pop(h, None)
            elif isinstance(event, Cleared):
                blocks.clear()
                keys.clear()
                self.cleared = True
        if events:
            self.changes += 1
        self.next_seq = seq + 1
        self._last = payload
