"""``/inference/v1/generate`` frames and bodies as vLLM's tokens-in route writes them.

vLLM's ``ServingTokens`` (``vllm/entrypoints/serve/disagg``): each stream chunk is ``data:
{"request_id", "choices": [{"index", "logprobs", "finish_reason", "token_ids"}]}``, the stream
ends with ``data: [DONE]``, errors are ``data: {"error": {...}}``; the whole answer is
``{"request_id", "choices", "prompt_logprobs", "kv_transfer_params"}`` with the descriptor always
present (null when there is none). The engine's request id is ``generate-tokens-`` + the
``X-Request-Id`` (or the body's ``request_id``). Token ``i`` is id ``1000 + i``.

Usage (0.33's ``scale_out/token_in_token_out/serving.py``): the whole answer carries ``usage``;
a stream whose ``stream_options.include_usage`` asks for it ends with a chunk of no choices and
the usage, dumped without its unset fields, before ``[DONE]``.

Invariant: byte templates per request; imports only ``chunks``.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.fake_engine.chunks import DONE, StreamFrames

FIRST_ID = 1000


class GenerateFrames(StreamFrames):
    """The token-in/token-out ``generate`` stream: ``token_ids`` per chunk, no text; usage as the module says."""

    __slots__ = ("_rid",)

    def __init__(self, rid: str) -> None:
        super().__init__(b"")
        self._rid = rid
        self._head = b'data: {"request_id":' + orjson.dumps(rid) + b',"choices":[{"index":0,"logprobs":null,'

    def token(self, i: int) -> bytes:
        """A chunk carrying token ``i``'s id, ``finish_reason`` null."""
        return self._head + b'"finish_reason":null,"token_ids":[' + str(FIRST_ID + i).encode() + b"]}]}\n\n"

    def last_token(self, i: int, finish_reason: str) -> bytes:
        """The final token's chunk, carrying ``finish_reason``."""
        finish = orjson.dumps(finish_reason)
        return self._head + b'"finish_reason":' + finish + b',"token_ids":[' + str(FIRST_ID + i).encode() + b"]}]}\n\n"

    def heartbeat(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """A chunk with no choices: nothing generated, the stream kept alive."""
        return b'data: {"request_id":' + orjson.dumps(self._rid) + b',"choices":[]}\n\n'

    def empty_end(self, prompt_tokens: int, include_usage: bool, cached_tokens: int = 0) -> bytes:
        """An immediate stop: one chunk with no token ids, then the usage if asked, ``[DONE]``."""
        return (self._head + b'"finish_reason":"stop","token_ids":[]}]}\n\n'
                + self.end(prompt_tokens, 0, include_usage, "stop", cached_tokens))

    def end(
        self, prompt_tokens: int, completion_tokens: int, include_usage: bool, finish_reason: str,
        cached_tokens: int = 0,
    ) -> bytes:
        """The usage chunk when ``include_usage`` asked for it, then ``[DONE]``."""
        if not include_usage:
            return DONE
        usage = _usage(prompt_tokens, completion_tokens)
        return (b'data: {"request_id":' + orjson.dumps(self._rid) + b',"usage":' + orjson.dumps(usage)
                + b',"choices":[]}\n\n' + DONE)

    def body(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The whole answer with its usage (the cached part only with prompt-token details, as vLLM)."""
        ids = list(range(FIRST_ID, FIRST_ID + completion_tokens))
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason, "token_ids": ids}
        return {"request_id": self._rid, "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens),
                "prompt_logprobs": None, "kv_transfer_params": None}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}
