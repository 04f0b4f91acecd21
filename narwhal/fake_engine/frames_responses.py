"""``/v1/responses`` frames and bodies as vLLM's Responses server writes them.

A text stream (``vllm/entrypoints/openai/responses``): ``response.created`` and
``response.in_progress`` (their response objects carry ``"kv_transfer_params": null``), then with
the first token ``response.output_item.added`` and ``response.content_part.added``, one
``response.output_text.delta`` per token, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (status
``completed``, or ``incomplete`` when ``max_output_tokens`` cut it). Every event carries a
``sequence_number``; there is no ``[DONE]``. Errors inside the stream: ``event: error``
(``{"type", "code", "message", "param", "sequence_number"}``), or ``response.failed`` (the
``flat`` variant of a stream-error fault). The whole answer is the response object, its
``kv_transfer_params`` always present (null without a descriptor); a one-token prefill answers
``status: "incomplete"``. The response id is the body's ``request_id`` (``resp_…`` by default).

Invariant: the frames object numbers the events it writes, so it is one per response; token
frames are byte templates; imports only ``chunks``.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.fake_engine.chunks import StreamFrames, token_bytes, token_text

HEARTBEAT = b": keep-alive\n\n"


def event(name: bytes, data: bytes) -> bytes:
    """One named SSE event (``event:`` and ``data:`` lines)."""
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


class ResponsesFrames(StreamFrames):
    """The ``/v1/responses`` stream and body; numbers its events, so one per response."""

    __slots__ = ("_rid", "_model", "_created", "_limit", "_seq", "_item", "_incomplete_event")

    def __init__(self, model: str, rid: str, created: int, max_output_tokens: int | None,
                 incomplete_event: bool = True) -> None:
        # 0.33 ends a stream cut by max_output_tokens with ``response.incomplete``; a real 0.32
        # engine with ``response.completed`` whose status is "incomplete" (the real tier).
        self._incomplete_event = incomplete_event
        super().__init__(b"")
        self._rid, self._model, self._created, self._limit = rid, model, created, max_output_tokens
        self._seq = 0
        self._item = "msg_" + rid
        ids = b'"item_id":' + orjson.dumps(self._item) + b',"output_index":0,"content_index":0'
        self._head = b',' + ids + b',"delta":"'
        self._tail = b'","logprobs":[]}\n\n'

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _event(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._next()
        return event(data["type"].encode(), orjson.dumps(data))

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object in ``status`` with ``output`` and ``usage``, every field vLLM dumps."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self._rid, "created_at": self._created, "incomplete_details": incomplete, "instructions": None,
            "metadata": None, "model": self._model, "object": "response", "output": output,
            "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "background": False, "max_output_tokens": self._limit, "previous_response_id": None,
            "reasoning": None, "service_tier": "auto", "status": status, "text": None, "truncation": "disabled",
            "usage": usage, "user": None, "kv_transfer_params": None,
        }

    def _part(self, text: str) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [self._part(text)] if status == "completed" else []
        return {"id": self._item, "content": content, "role": "assistant", "status": status, "type": "message"}

    def token(self, i: int) -> bytes:
        """A ``response.output_text.delta``; the first token opens the output item and its part."""
        opened = self._open_item() if i == 0 else b""
        return opened + (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":'
            + str(self._next()).encode() + self._head + token_bytes(i) + self._tail
        )

    def last_token(self, i: int, finish_reason: str) -> bytes:
        """Like any token: the status comes with ``response.completed``."""
        return self.token(i)

    def heartbeat(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """An SSE comment: it takes no sequence number."""
        return HEARTBEAT

    def _open_item(self) -> bytes:
        added = self._event({"type": "response.output_item.added", "output_index": 0,
                             "item": self._message("", "in_progress")})
        return added + self._event({"type": "response.content_part.added", "item_id": self._item,
                                    "output_index": 0, "content_index": 0, "part": self._part("")})

    def _close_item(self, text: str) -> bytes:
        where = {"item_id": self._item, "output_index": 0, "content_index": 0}
        done = self._event({"type": "response.output_text.done", **where, "text": text, "logprobs": []})
        done += self._event({"type": "response.content_part.done", **where, "part": self._part(text)})
        return done + self._event({"type": "response.output_item.done", "output_index": 0,
                                   "item": self._message(text, "completed")})

    def opening(self, prompt_tokens: int) -> bytes:
        """``response.created`` and ``response.in_progress``, before any token."""
        created = self._event({"type": "response.created", "response": self.response("in_progress", [], None)})
        return created + self._event({"type": "response.in_progress",
                                      "response": self.response("in_progress", [], None)})

    def _completed(self, text: str | None, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        status = "incomplete" if self._limit is not None and completion_tokens >= self._limit else "completed"
        output = [] if text is None else [self._message(text, "completed")]
        usage = usage_object(prompt_tokens, completion_tokens, cached_tokens)
        kind = "response.incomplete" if status == "incomplete" and self._incomplete_event else "response.completed"
        return self._event({"type": kind, "response": self.response(status, output, usage)})

    def terminal_first(self) -> bytes:
        """``response.completed`` with no output: the terminal event with nothing before it."""
        return self._completed(None, 0, 0)

    def empty_end(self, prompt_tokens: int, include_usage: bool, cached_tokens: int = 0) -> bytes:
        """An empty answer: the output item opened and closed empty, then ``response.completed``."""
        return self._open_item() + self._close_item("") + self._completed("", prompt_tokens, 0, cached_tokens)

    def end(
        self, prompt_tokens: int, completion_tokens: int, include_usage: bool, finish_reason: str,
        cached_tokens: int = 0,
    ) -> bytes:
        """The item's closing events with the whole text, then ``response.completed`` (or incomplete)."""
        text = "".join([token_text(i) for i in range(completion_tokens)])
        return self._close_item(text) + self._completed(text, prompt_tokens, completion_tokens, cached_tokens)

    def failed(self, code: int | None, message: str) -> dict[str, Any]:
        """A Response that failed: what ``response.failed`` carries, or a whole answer is."""
        failed = self.response("failed", [], None)
        failed["error"] = {"code": code, "message": message}
        return failed

    def error(self, code: int | None, message: str, flat: bool) -> bytes:
        """``event: error``, or ``flat``: the newer ``response.failed``."""
        if flat:  # the newer response.failed form
            return self._event({"type": "response.failed", "response": self.failed(code, message)})
        return self._event({"type": "error", "code": code, "message": message, "param": None})

    def body(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The whole (non-streaming) response, ``incomplete`` when ``max_output_tokens`` cut it."""
        status = "incomplete" if self._limit is not None and completion_tokens >= self._limit else "completed"
        usage = usage_object(prompt_tokens, completion_tokens, cached_tokens)
        return self.response(status, [self._message(text, "completed")], usage)


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """vLLM's ``ResponseUsage``: ``input_tokens_details.cached_tokens`` is always there (0 on a miss)."""
    return {
        "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }
