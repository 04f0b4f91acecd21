"""A KV-event batch's payload, decoded: both shapes vLLM has sent, and nothing trusted.

vLLM's payload is msgpack ``[ts, events, data_parallel_rank]``; each event is a map tagged
``"type"`` from 0.24 on (unset defaults left out, unknown keys possible from newer releases),
a positional array before (``["BlockStored", block_hashes, parent, token_ids, block_size, ...]``).
A hash is a 64-bit int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or 32 bytes.

Invariant: pure; whatever the bytes hold, :func:`decode_batch` returns events or raises
:class:`Unreadable` (one line, the subscriber counts it and treats the stream as gapped): never
another exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_DECODER = msgspec.msgpack.Decoder()


class Unreadable(ValueError):
    """A payload that is not a batch of KV events in a shape vLLM sends."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks cached, in chain order: ``parent`` is the hash before the first (None: token 0)."""

    hashes: tuple[int | bytes, ...]
    parent: int | bytes | None
    tokens: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks evicted."""

    hashes: tuple[int | bytes, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block dropped (``reset_prefix_cache``)."""


Event = Stored | Removed | Cleared


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """The batch's timestamp and events; :class:`Unreadable` when it is not one."""
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise Unreadable(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise Unreadable("not [ts, events, rank]")
    ts = batch[0]
    if type(ts) not in (int, float):
        raise Unreadable("its timestamp is not a number")
    events = []
    for raw in batch[1]:
        event = _event(raw)
        if event is not None:
            events.append(event)
    return float(ts), events


def _hash(value: Any) -> int | bytes:
    if (type(value) is int and 0 <= value < 1 << 64) or (type(value) is bytes and 0 < len(value) <= 64):
        return value
    raise Unreadable(f"a block hash that is neither a 64-bit int nor a digest: {value!r:.40}")


def _hashes(value: Any) -> tuple[int | bytes, ...]:
    if not isinstance(value, list):
        raise Unreadable("block_hashes is not a list")
    return tuple(_hash(v) for v in value)


def _event(raw: Any) -> Event | None:
    """One event (None: a kind this router does not know: ignored, as newer releases may add some)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
        get = fields.get
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                 "BlockRemoved": ("block_hashes",)}.get(kind, ())
        positional = dict(zip(names, raw[1:], strict=False))
        get = positional.get
    else:
        raise Unreadable("an event that is neither a tagged map nor an array")
    if kind == "BlockStored":
        tokens, size, parent = get("token_ids"), get("block_size"), get("parent_block_hash")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise Unreadable("token_ids is not a list of ints")
        if type(size) is not int or size <= 0:
            raise Unreadable("block_size is not a positive int")
        return Stored(_hashes(get("block_hashes")), None if parent is None else _hash(parent), tuple(tokens), size)
    if kind == "BlockRemoved":
        return Removed(_hashes(get("block_hashes")))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None
