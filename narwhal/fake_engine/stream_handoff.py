"""A streamed prefill's handoff, as vLLM 0.33 sends it: on the chunk with the ``finish_reason``.

0.33's chat and completions chunks say ``"kv_transfer_params": null``, but the last chunk of a
prefill that asked for a remote decode carries the descriptor, and its blocks are held for a
consumer as a non-streamed prefill's are. A real 0.32 engine sent no descriptor in a stream at
all and pinned the blocks until the lease; releases before 0.33 keep that (``generate``'s
``_stream_end``). The router never streams a prefill; this is the fake being faithful.

Invariant: only the final token's frame changes, by its fixed tail; imports ``kv`` and ``chunks``.
"""

from __future__ import annotations

from typing import Any, cast

import orjson

from narwhal.fake_engine import kv
from narwhal.fake_engine.chunks import StreamFrames
from narwhal.fake_engine.parse import ParsedRequest
from narwhal.fake_engine.state import EngineState

_NULL_TAIL = b'"kv_transfer_params":null}\n\n'


class _HandoffOnLast:
    """``frames`` with the descriptor in place of the last frame's null ``kv_transfer_params``."""

    __slots__ = ("_frames", "_descriptor")

    def __init__(self, frames: StreamFrames, descriptor: bytes) -> None:
        self._frames = frames
        self._descriptor = descriptor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._frames, name)

    def last_token(self, i: int, finish_reason: str) -> bytes:
        frame = self._frames.last_token(i, finish_reason)
        assert frame.endswith(_NULL_TAIL), "a 0.33 chunk ends with its kv_transfer_params"
        return frame[: -len(_NULL_TAIL)] + b'"kv_transfer_params":' + self._descriptor + b"}\n\n"


def with_handoff(engine: EngineState, req: ParsedRequest, frames: StreamFrames, rid: str) -> StreamFrames | None:
    """``frames`` carrying the handoff on the last chunk when this stream is a 0.33 prefill that
    asked for a remote decode (the blocks are held from here); None otherwise."""
    params = req.kv_params
    if not (engine.release.since_033 and req.kind in ("chat", "completions") and params is not None
            and params.get("do_remote_decode") is True):
        return None
    descriptor = kv.producer_descriptor(engine, params, rid, req.prompt_tokens, None, 0)
    if descriptor is None or descriptor is kv.MISSING:
        return None
    return cast(StreamFrames, _HandoffOnLast(frames, orjson.dumps(descriptor)))
