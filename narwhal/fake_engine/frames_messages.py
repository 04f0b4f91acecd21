"""``/v1/messages`` frames and bodies as vLLM's Anthropic server writes them.

vLLM serves Messages by converting to a chat request and converting its chunks back
(``vllm/entrypoints/anthropic``): ``message_start`` from the first chunk, ``content_block_start``
with the first text, a ``content_block_delta`` per token, then ``content_block_stop``,
``message_delta`` (stop reason, usage) and ``message_stop``, followed by ``data: [DONE]``. Events
are pydantic dumps with ``exclude_unset``, so only the fields vLLM sets appear, in field order. An
error inside the stream is ``event: error`` with ``{"type": "error", "error": {...}}``, then
``[DONE]``. The non-streaming message is dumped with ``exclude_none``: ``kv_transfer_params`` is
absent, not null, when there is no descriptor. vLLM sends no ``ping``: heartbeats are SSE
comments.

Invariant: byte templates per request (head + token + tail) like ``chunks``, so a token costs no
JSON encoding; imports only ``chunks``.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from narwhal.fake_engine.chunks import DONE, StreamFrames, error_event, token_bytes

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TYPE_OF_CODE = {400: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
HEARTBEAT = b": keep-alive\n\n"


def event(name: str, data: bytes) -> bytes:
    """One named SSE event (``event:`` and ``data:`` lines)."""
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


def anthropic_error(code: int | None, message: str) -> dict[str, Any]:
    """Anthropic's error object; its ``type`` follows the status so tests reach each mapping."""
    # vLLM's converter always says internal_error; other types let tests exercise the mapping.
    kind = _TYPE_OF_CODE.get(code or 500, "internal_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str) -> web.Response:
    """An HTTP error in Anthropic's shape, as vLLM's Messages handler answers."""
    body = orjson.dumps(anthropic_error(status, message))
    return web.Response(body=body, status=status, content_type="application/json")


class MessagesFrames(StreamFrames):
    """The ``/v1/messages`` stream and body (module docstring for the event order)."""

    __slots__ = ("_rid", "_model")

    def __init__(self, model_json: bytes, rid: str) -> None:
        super().__init__(b"")
        self._rid, self._model = rid, model_json
        self._head = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":"'
        )
        self._tail = b'"},"index":0}\n\n'

    def token(self, i: int) -> bytes:
        """A ``content_block_delta``; the first token opens the block with ``content_block_start``."""
        frame = self._head + token_bytes(i) + self._tail
        if i == 0:
            start = b'{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}'
            return event("content_block_start", start) + frame
        return frame

    def last_token(self, i: int, finish_reason: str) -> bytes:
        """Like any token: the stop reason comes in ``message_delta`` at the end."""
        return self.token(i)

    def heartbeat(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """An SSE comment: vLLM sends no ``ping`` event."""
        return HEARTBEAT

    def opening(self, prompt_tokens: int) -> bytes:
        """``message_start``, with the prompt's input tokens and no output yet."""
        message = (
            b'{"id":' + orjson.dumps(self._rid) + b',"content":[],"model":' + self._model
            + b',"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":' + str(prompt_tokens).encode()
            + b',"output_tokens":0}}'
        )
        return event("message_start", b'{"type":"message_start","message":' + message + b"}")

    def _delta(self, stop_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        data = {"type": "message_delta", "delta": {"stop_reason": stop_reason},
                "usage": usage_object(prompt_tokens, completion_tokens, cached_tokens)}
        return event("message_delta", orjson.dumps(data))

    def terminal_first(self) -> bytes:
        """``message_stop`` then ``[DONE]``: the terminal event, also the whole end of an empty answer."""
        return event("message_stop", b'{"type":"message_stop"}') + DONE

    def empty_end(self, prompt_tokens: int, include_usage: bool, cached_tokens: int = 0) -> bytes:
        """An empty answer: ``message_delta`` (``end_turn``, usage) and the terminal event."""
        return self._delta("end_turn", prompt_tokens, 0, cached_tokens) + self.terminal_first()

    def end(
        self, prompt_tokens: int, completion_tokens: int, include_usage: bool, finish_reason: str,
        cached_tokens: int = 0,
    ) -> bytes:
        """``content_block_stop``, ``message_delta`` (stop reason, usage), ``message_stop``, ``[DONE]``."""
        stop = event("content_block_stop", b'{"type":"content_block_stop","index":0}')
        stop_reason = STOP_REASONS.get(finish_reason, "end_turn")
        delta = self._delta(stop_reason, prompt_tokens, completion_tokens, cached_tokens)
        return stop + delta + self.terminal_first()

    def error(self, code: int | None, message: str, flat: bool) -> bytes:
        """``event: error`` in Anthropic's shape, or ``flat``: OpenAI's, as vLLM's chat layer writes it."""
        if flat:  # OpenAI's shape, as vLLM's chat layer writes it: routers must read both
            return error_event(code, message) + DONE
        return event("error", orjson.dumps(anthropic_error(code, message))) + DONE

    def body(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The whole (non-streaming) message, without ``kv_transfer_params`` decided yet."""
        return {
            "id": self._rid, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": text}], "model": orjson.loads(self._model),
            "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
            "usage": usage_object(prompt_tokens, completion_tokens, cached_tokens),
        }


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens *not* read from the cache, and
    ``cache_read_input_tokens`` (only when some were: vLLM dumps with ``exclude_none``) the rest."""
    usage: dict[str, Any] = {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens}
    if cached_tokens:
        usage["cache_read_input_tokens"] = cached_tokens
    return usage
