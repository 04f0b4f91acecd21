"""``/v1/messages``: Anthropic's Messages API as vLLM serves it (``vllm/entrypoints/anthropic``).

Frames are ``event: <type>\\ndata: <json>``; the stream ends with ``event: message_stop``, which
vLLM follows with ``data: [DONE]`` (also after an error event). That ``[DONE]`` is not part of
Anthropic's protocol, so nothing requires it and the router drops what follows the terminal
event: an Anthropic client sees Anthropic's stream. Generated output (docs/behaviour.md "The other P/D endpoints"): a
``content_block_delta`` of text, thinking or tool input, a ``tool_use`` ``content_block_start``,
and a ``message_delta`` carrying ``stop_reason`` (an immediate end of sequence is a valid empty
answer). An in-stream error is ``event: error`` in Anthropic's shape, or OpenAI's
``{"error": {...}}`` (vLLM's chat layer under the converter); both are understood.

The router's own errors reach Messages clients in Anthropic's shape, with the status and the
``x-narwhal-error`` header they have everywhere.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.engines import connector, sse
from narwhal.engines.dialects.base import (
    Dialect,
    Kind,
    bad,
    content_text,
    event_name,
    json_of,
    status_of_code,
    token_count,
    turns_answer,
    turns_text,
)
from narwhal.errors import NarwhalError

MESSAGES = "/v1/messages"

# The Anthropic error type a client sees for each status (docs/behaviour.md "The other P/D endpoints").
_TYPE_OF_STATUS = {
    400: "invalid_request_error", 408: "invalid_request_error", 415: "invalid_request_error",
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 431: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}
# An engine's Anthropic error type, as the HTTP status it propagates with (529 is Anthropic's
# "overloaded"; HTTP clients and load balancers know it as 503).
_STATUS_OF_TYPE = {"overloaded_error": 503, "rate_limit_error": 429, "invalid_request_error": 400}
_OUTPUT_DELTAS = frozenset({"text_delta", "thinking_delta", "input_json_delta"})


def anthropic_type(status: int) -> str:
    """The Anthropic error ``type`` a Messages client sees for a status."""
    known = _TYPE_OF_STATUS.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


class Messages(Dialect, endpoint=MESSAGES, prompt_fields=("system", "messages"), terminal="message_stop",
               terminal_bytes=None):
    """``/v1/messages``: Anthropic's events, ``message_stop`` terminal, errors in Anthropic's shape."""

    __slots__ = ()

    def check(self, body: dict[str, Any]) -> None:
        """``messages`` a list of objects and ``max_tokens`` present, as Anthropic requires."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise bad("'messages' must be a list of objects")
        limit = body.get("max_tokens")
        if limit is None:
            raise bad("'max_tokens' is required", "max_tokens")
        # vLLM's request validation (not its handler: the consumer would not free the handoff,
        # and the prefill, which sets max_tokens to 1, would pass): refused before any prefill.
        if type(limit) is not int or limit < 1:
            raise bad("max_tokens must be positive", "max_tokens")
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise bad("'system' must be a string or a list of content blocks")
        stops = body.get("stop_sequences")
        if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise bad("'stop_sequences' must be a list of strings", "stop_sequences")

    def affinity_text(self, body: dict[str, Any], limit: int) -> str:
        """The system prompt, then each message as ``role: text``, until ``limit`` characters."""
        return turns_text(content_text(body.get("system")), body.get("messages"), limit)

    def answer_span(self, body: dict[str, Any], limit: int) -> tuple[int, int] | None:
        """The last ``assistant`` message a later one follows, as :meth:`affinity_text` writes it."""
        return turns_answer(content_text(body.get("system")), body.get("messages"), limit)

    def prompt_usage(self, usage: Any) -> tuple[int | None, int | None]:
        """Anthropic's usage: ``input_tokens`` are the tokens *not* read from or written to the
        cache, so the prompt is their sum with ``cache_read_input_tokens`` and
        ``cache_creation_input_tokens``; the cached part is ``cache_read_input_tokens`` (None
        when the engine left it out). Each part and the sum are bounded as any count is
        (``token_count``): three counts each in range can add up out of it."""
        if not isinstance(usage, dict):
            return None, None
        uncached = token_count(usage.get("input_tokens"))
        if uncached is None:
            return None, None
        cached = token_count(usage.get("cache_read_input_tokens"))
        written = token_count(usage.get("cache_creation_input_tokens")) or 0
        return token_count(uncached + (cached or 0) + written), cached

    def prefill_body(self, body: dict[str, Any], request_id: str, crossed: bool) -> dict[str, Any]:
        """One token, not streamed, ``stop_sequences`` dropped so nothing ends it early."""
        out = dict(body)
        out.pop("stop_sequences", None)  # the single token must not end the request early
        out["stream"] = False
        out["max_tokens"] = 1
        connector.ask_for_handoff(out, crossed)
        return out

    def release_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """One token, not streamed, carrying the descriptor to free."""
        out = dict(body)
        out["stream"] = False
        out["max_tokens"] = 1
        out["kv_transfer_params"] = descriptor
        return out

    def may_end(self, span: bytes) -> bool:
        """Could ``span`` hold ``message_stop`` or an error (Anthropic's or OpenAI's)?"""
        # An Anthropic error's data holds "type":"error"; OpenAI's holds the key "error".
        return b"message_stop" in span or b'"error"' in span

    def clean_end(self, span: bytes) -> int:
        """The length through ``message_stop`` (a ``[DONE]`` after it dropped) when output ends there; else -1."""
        at = span.rfind(b"event: message_stop\n")
        if at < 0 or (at and span[at - 2 : at] != b"\n\n") or b'"error"' in span:
            return -1
        end = span.find(b"\n\n", at) + 2
        if span.count(b"message_stop") != 2 or (end != len(span) and span[end:] != sse.DONE_EVENT):
            return -1  # more than the terminal event, or something after it: judge each event
        return end

    def classify(self, event: bytes) -> tuple[Kind, dict[str, Any] | None]:
        """By event name (or the data's ``type``); an error in either shape is normalised."""
        obj = json_of(event)
        name = event_name(event)
        if name is None and isinstance(obj, dict):
            kind = obj.get("type")
            name = kind.encode() if isinstance(kind, str) else None
        if name == b"message_stop":
            return Kind.DONE, None
        if not isinstance(obj, dict):
            return Kind.METADATA, None
        if name == b"error":
            return Kind.ERROR, _anthropic_error(obj)
        openai = sse.error_object(obj) if name is None else None
        if openai is not None:
            return Kind.ERROR, {"code": status_of_code(openai.get("code")), "message": openai.get("message")}
        return (Kind.TOKEN if _is_output(name, obj) else Kind.METADATA), None

    def error_body(self, exc: NarwhalError) -> bytes:
        """Anthropic's ``{"type": "error", "error": {...}}``."""
        error = {"type": anthropic_type(exc.status), "message": exc.message}
        return orjson.dumps({"type": "error", "error": error})

    def error_event(self, exc: NarwhalError) -> bytes:
        """``event: error`` with Anthropic's error body."""
        return b"event: error\ndata: " + self.error_body(exc) + b"\n\n"


def _anthropic_error(obj: dict[str, Any]) -> dict[str, Any]:
    err = obj.get("error")
    if not isinstance(err, dict):
        return {"code": None, "message": None}
    kind = err.get("type")
    return {"code": _STATUS_OF_TYPE.get(kind) if isinstance(kind, str) else None, "message": err.get("message")}


def _is_output(name: bytes | None, obj: dict[str, Any]) -> bool:
    if name == b"content_block_delta":
        delta = obj.get("delta")
        return isinstance(delta, dict) and delta.get("type") in _OUTPUT_DELTAS
    if name == b"content_block_start":
        block = obj.get("content_block")
        return isinstance(block, dict) and block.get("type") == "tool_use"
    if name == b"message_delta":
        delta = obj.get("delta")
        return isinstance(delta, dict) and delta.get("stop_reason") is not None
    return False



