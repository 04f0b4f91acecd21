"""``/v1/responses``: OpenAI's Responses API as vLLM serves it (``vllm/entrypoints/openai/responses``).

Frames are ``event: <type>\\ndata: <json>``; a valid stream ends with ``response.completed``
(status ``completed`` or ``incomplete``) or ``response.incomplete``, never with ``[DONE]``.
Generated output (docs/behaviour.md "The other P/D endpoints"): text, reasoning and function-call argument deltas, an
``output_item.added`` of a function call that carries arguments, and ``output_item.done`` (the
analogue of a ``finish_reason``). An in-stream error is ``event: error`` or ``response.failed``,
with its ``code`` as the status when it is one, else 502.

What this path cannot honour is refused at admission: a ``previous_response_id`` names a response
stored inside one engine process (the other leg would not find it), and ``background: true``
answers at once with a queued response (no stream to relay). The body's ``request_id`` is the
engine's request id on this path (``X-Request-Id`` is not read), so both legs get the backend id.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.engines import connector
from narwhal.engines.dialects.base import (
    Dialect,
    Kind,
    bad,
    event_name,
    is_int,
    json_of,
    status_of_code,
    token_count,
    turns_answer,
    turns_text,
)
from narwhal.errors import NarwhalError

RESPONSES = "/v1/responses"

_OUTPUT_EVENTS = frozenset({
    b"response.output_text.delta", b"response.reasoning_text.delta", b"response.function_call_arguments.delta",
    b"response.output_item.done",
})
_TERMINAL_EVENTS = frozenset({b"response.completed", b"response.incomplete"})



def response_id(request_id: str) -> str:
    """The body's ``request_id`` for a backend id: vLLM uses it as the Response's ``id`` as given,
    and its own ids are ``resp_…`` (``ResponsesRequest``'s default): clients and SDKs that look
    for the prefix find it."""
    return request_id if request_id.startswith("resp_") else "resp_" + request_id


def _one_token(body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The client's body for a one-token leg (a prefill, a release): not streamed, not stored."""
    out = dict(body)
    out.pop("stream_options", None)
    out.update(stream=False, max_output_tokens=1, store=False, request_id=response_id(request_id))
    return out


class Responses(Dialect, endpoint=RESPONSES, prompt_fields=("instructions", "input"), terminal="response.completed",
                terminal_bytes=None):
    """``/v1/responses``: named events, ``response.completed`` terminal, the body's ``request_id`` as id."""

    __slots__ = ()

    def check(self, body: dict[str, Any]) -> None:
        """Refuse what two legs cannot honour (a stored previous response, background) and bad types."""
        if body.get("previous_response_id") is not None:
            raise bad("'previous_response_id' is not supported by disaggregated serving: the stored "
                      "response lives inside one engine process, which the other leg cannot read")
        if body.get("background") is True:
            raise bad("'background: true' is not supported by disaggregated serving: a background "
                      "response has no stream to relay")
        if not isinstance(body.get("input"), str | list):
            raise bad("'input' must be a string or a list of input items")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("'instructions' must be a string")
        limit = body.get("max_output_tokens")
        if limit is not None and (not is_int(limit) or limit < 0):
            raise bad("'max_output_tokens' must be an integer >= 0")

    def affinity_text(self, body: dict[str, Any], limit: int) -> str:
        """The instructions, then the input (text, or each item as ``role: text``) until ``limit``."""
        instructions = body.get("instructions")
        head = instructions if isinstance(instructions, str) else ""
        items = body.get("input")
        if isinstance(items, str):
            return "\n".join(p for p in (head, items) if p)
        return turns_text(head, items, limit)

    def answer_span(self, body: dict[str, Any], limit: int) -> tuple[int, int] | None:
        """The last ``assistant`` item a later one follows, as :meth:`affinity_text` writes it."""
        instructions = body.get("instructions")
        return turns_answer(instructions if isinstance(instructions, str) else "", body.get("input"), limit)

    def prompt_usage(self, usage: Any) -> tuple[int | None, int | None]:
        """``input_tokens`` and ``input_tokens_details.cached_tokens`` (vLLM's ResponseUsage)."""
        if not isinstance(usage, dict):
            return None, None
        details = usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return token_count(usage.get("input_tokens")), token_count(cached)

    def prefill_body(self, body: dict[str, Any], request_id: str, crossed: bool) -> dict[str, Any]:
        """One output token, not streamed, not stored, not background; the backend id as ``request_id``."""
        out = _one_token(body, request_id)
        out["background"] = False
        connector.ask_for_handoff(out, crossed)
        return out

    def decode_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any] | None) -> dict[str, Any]:
        """The base decode body with the backend id as ``request_id`` (vLLM reads no ``X-Request-Id`` here)."""
        out = super().decode_body(body, request_id, descriptor)
        out["request_id"] = response_id(request_id)
        return out

    def release_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """One output token, not streamed, not stored, carrying the descriptor to free."""
        out = _one_token(body, request_id)
        out["kv_transfer_params"] = descriptor
        return out

    def may_end(self, span: bytes) -> bool:
        """Could ``span`` hold a terminal event, ``response.failed`` or an error?"""
        return b"response.completed" in span or b"response.incomplete" in span or b'"error"' in span \
            or b"response.failed" in span

    def clean_end(self, span: bytes) -> int:
        """The whole span when it is output then one ``response.completed``, no error; else -1."""
        at = span.rfind(b"event: response.completed\n")
        if at < 0 or (at and span[at - 2 : at] != b"\n\n") or not span.endswith(b"\n\n"):
            return -1
        # Response objects carry "error": null; any other "error" may be one: judge each event.
        if span.count(b'"error"') != span.count(b'"error":null') or b"response.failed" in span:
            return -1
        if span.count(b"response.completed") != 2 or b"response.incomplete" in span \
                or span.find(b"\n\n", at) + 2 != len(span):
            return -1
        return len(span)

    def classify(self, event: bytes) -> tuple[Kind, dict[str, Any] | None]:
        """By event name (or the data's ``type``); ``error`` and ``response.failed`` are errors."""
        obj = json_of(event)
        name = event_name(event)
        if name is None and isinstance(obj, dict) and isinstance(obj.get("type"), str):
            name = obj["type"].encode()
        if name in _TERMINAL_EVENTS:
            return Kind.DONE, None
        if not isinstance(obj, dict):
            return Kind.METADATA, None
        if name == b"error":
            return Kind.ERROR, _normalised(obj)
        if name == b"response.failed":
            response = obj.get("response")
            return Kind.ERROR, _normalised(response.get("error") if isinstance(response, dict) else None)
        if name is None and isinstance(obj.get("error"), dict):  # OpenAI's shape, before the converter
            return Kind.ERROR, _normalised(obj["error"])
        if name in _OUTPUT_EVENTS:
            return Kind.TOKEN, None
        if name == b"response.output_item.added":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call" and item.get("arguments"):
                return Kind.TOKEN, None
        return Kind.METADATA, None

    def whole_error(self, data: bytes) -> dict[str, Any] | None:
        """A non-streaming body whose response has ``status: "failed"``, its error normalised."""
        if b'"failed"' not in data:
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("status") != "failed":
            return None
        return _normalised(obj.get("error"))

    def error_event(self, exc: NarwhalError) -> bytes:
        """``event: error`` in the Responses shape (``code``, ``message``, ``param``)."""
        event = {"type": "error", "code": exc.status, "message": exc.message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


def _normalised(err: Any) -> dict[str, Any]:
    err = err if isinstance(err, dict) else {}
    return {"code": status_of_code(err.get("code")), "message": err.get("message")}
