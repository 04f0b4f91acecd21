"""The fake's KV-cache events, sent as vLLM's ``ZmqEventPublisher`` sends them.

What a real engine started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", ...}'`` does (``vllm/distributed/kv_events.py``, per release):

- a ZMQ **PUB** socket sends each batch as three frames ``[topic, seq, payload]``: ``seq`` an
  8-byte big-endian counter from 0 per publisher (a restarted engine starts again at 0), the
  payload msgpack ``[ts, events, data_parallel_rank]``;
- events are ``BlockStored`` (``block_hashes`` in chain order, ``parent_block_hash``,
  ``token_ids``, ``block_size``, ...), ``BlockRemoved`` (one per evicted hash) and
  ``AllBlocksCleared``: maps tagged ``"type"`` with unset defaults left out from 0.24 on,
  positional arrays before (0.21 has no ``kv_cache_spec_*`` fields);
- a **ROUTER** replay socket answers ``[b"", start_seq]`` with every kept batch from
  ``start_seq`` on (``[b"", topic, seq, payload]``; no topic before 0.26), then the end marker
  ``[b"", b"", ff×8, b""]``; only the last ``buffer_steps`` batches are kept, and a start older
  than them silently replays from the oldest kept;
- ``GET /kv_event_sources`` (0.31 on) lists the publisher's resolved config by DP rank.

Block hashes are vLLM's default chain (``sha256`` over ``pickle`` of ``(parent digest, token
ids, None)``, the first block's parent ``sha256(pickle("vllm-none-hash"))`` from 0.29 on, a
random seed before) sent as the digest's low 64 bits. Token ids are the fake's own (a 4-character
piece of the prompt text each, ``prefix``), the same its ``/tokenize`` answers.

Faults for the router's tests (``gap``, ``gap_past_replay``, ``duplicate``, ``silence``; a
restart is :meth:`EngineState.restarted`'s: a new publisher, ``seq`` from 0).

Invariant: what is sent is what a real publisher of the release would send for the same blocks;
nothing here awaits in the request path (a send never blocks: a subscriber past ``hwm`` loses
messages, as with vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pickle
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)
NONE_HASH_SEED = "vllm-none-hash"
BUFFER_STEPS = 10_000
HWM = 100_000
_ENCODER = msgspec.msgpack.Encoder()


def _digest(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(version_tuple: tuple[int, int]) -> bytes:
    """The first block's parent digest: the fixed seed from 0.29 on, random per process before."""
    if version_tuple >= (0, 29):
        return _digest(NONE_HASH_SEED)
    return os.urandom(32)


def chain(tokens: list[int], block_size: int, seed: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
    """vLLM's hash chain over the full blocks of ``tokens``: (digest, block tokens) per block."""
    out: list[tuple[bytes, tuple[int, ...]]] = []
    parent = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = _digest((parent, block, None))
        out.append((parent, block))
    return out


def event_hash(digest: bytes) -> int:
    """A digest as events carry it: its low 64 bits (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class Stored:
    """One run of newly cached blocks: their hashes in chain order, the parent of the first, tokens."""

    hashes: list[int]
    parent: int | None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Removed:
    """One evicted block."""

    hash: int


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block dropped (``reset_prefix_cache``)."""


Event = Stored | Removed | Cleared


def encode_event(event: Event, block_size: int, version: tuple[int, int]) -> Any:
    """One event in the release's shape (the module's text)."""
    if isinstance(event, Stored):
        extra = [None] * len(event.hashes)
        if version >= (0, 24):
            return {"type": "BlockStored", "block_hashes": event.hashes, "parent_block_hash": event.parent,
                    "token_ids": event.tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                    "lora_name": None, "extra_keys": extra, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        fields = ["BlockStored", event.hashes, event.parent, event.tokens, block_size, None, "GPU", None, extra, 0]
        return [*fields, "full_attention", None] if version >= (0, 22) else fields
    if isinstance(event, Removed):
        if version >= (0, 24):
            return {"type": "BlockRemoved", "block_hashes": [event.hash], "medium": "GPU", "group_idx": 0}
        return ["BlockRemoved", [event.hash], "GPU", 0]
    return {"type": "AllBlocksCleared"} if version >= (0, 24) else ["AllBlocksCleared"]


def encode_batch(encoded: list[Any], ts: float) -> bytes:
    """One batch's payload: ``[ts, events, data_parallel_rank]`` (vLLM's ``KVEventBatch``, an array)."""
    return _ENCODER.encode([ts, encoded, 0])


class KvEventPublisher:
    """One engine's publisher: PUB for live batches, ROUTER for replay (the module's text)."""

    def __init__(self, version: tuple[int, int], topic: str, block_size: int, host: str = "127.0.0.1",
                 buffer_steps: int = BUFFER_STEPS) -> None:
        self.version = version
        self.topic = topic.encode()
        self.block_size = block_size
        self.buffer_steps = buffer_steps
        self._ctx = zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(HWM)
        self.port = int(self._pub.bind_to_random_port(f"tcp://{host}"))
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        if version >= (0, 33):
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
        self.replay_port = int(self._replay.bind_to_random_port(f"tcp://{host}"))
        self.host = host
        self._seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.fault: str | None = None  # "gap", "gap_past_replay", "duplicate", "silence": the next batch's
        self.sent = 0  # batches sent live
        self._server: asyncio.Task[None] | None = None

    def restarted(self, version: tuple[int, int]) -> KvEventPublisher:
        """The publisher of the engine's next process: the same endpoints, ``seq`` from 0, nothing
        kept for replay. (The sockets stay bound: a port freed and bound again at once is not
        always free yet; subscribers see what a restart shows them, a sequence from 0.)"""
        self.version = version
        self._seq = 0
        self._kept.clear()
        self.fault = None
        return self

    # -- the publisher's config, as /kv_event_sources lists it -------------------------------------

    def config(self) -> dict[str, Any]:
        """The eight ``KVEventsConfig`` fields, endpoints as this publisher resolved them."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{self.host}:{self.port}",
                "replay_endpoint": f"tcp://{self.host}:{self.replay_port}", "buffer_steps": self.buffer_steps,
                "hwm": HWM, "max_queue_size": 100_000, "topic": self.topic.decode()}

    # -- live --------------------------------------------------------------------------------------

    def publish(self, events: Iterable[Event]) -> None:
        """One scheduler step's events, as one batch (nothing when there are none)."""
        encoded = [encode_event(e, self.block_size, self.version) for e in events]
        if not encoded:
            return
        payload = encode_batch(encoded, time.time())
        seq = self._seq
        self._seq += 1
        fault, self.fault = self.fault, None
        if fault == "gap_past_replay":
            return  # neither sent nor kept: a replay cannot fill it
        self._kept.append((seq, payload))
        if fault in ("gap", "silence"):
            self.fault = "silence" if fault == "silence" else None
            return  # kept for replay, not sent
        frames = [self.topic, seq.to_bytes(8, "big"), payload]
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            if fault == "duplicate":
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            self.sent += 1

    # -- replay ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve replay requests (in the fake engine's loop) until :meth:`close`."""
        if self._server is None:
            self._server = asyncio.ensure_future(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:  # vLLM logs and ignores what is not [identity, b"", start]
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._kept):
                if seq >= first:
                    head = [identity, b"", self.topic] if self.version >= (0, 26) else [identity, b""]
                    await self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            tail = [identity, b"", b""] if self.version >= (0, 26) else [identity, b""]
            await self._replay.send_multipart([*tail, END_SEQ, b""])

    def close(self) -> None:
        """Stop publishing and serving replay; the ports are freed."""
        if self._server is not None:
            self._server.cancel()
            self._server = None
        self._pub.close(0)
        self._replay.close(0)
