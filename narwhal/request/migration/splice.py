"""A continuation's stream, rewritten into the stream its client was already reading.

The continuation is a new request to a new engine: its events carry their own id and
``created``, open with their own metadata (chat's role chunk, 0.33's ``prompt_token_ids``),
and count usage from their own prompt — which holds the output so far. The client must see one
stream, so each continuation event is rewritten before it goes out:

- OpenAI's (chat, completions, generate): the original's ``id`` (generate: ``request_id``) and
  ``created``; the role chunk dropped; ``usage`` counting the original prompt and every generated
  token (the output before the cut and the continuation's); everything else as the engine sent it.
- Messages continued in the chat form (``forms``): each chat chunk as the Anthropic event vLLM's
  own converter would have written — text deltas in the open text block, then at the end
  ``content_block_stop``, ``message_delta`` (the stop reason and usage) and ``message_stop``.

This runs only on continuation legs, after a migration: it parses each event (a JSON parse and
an encode per event), a cost the streams that never migrate do not pay.

Invariant: events go out in the order received, each at most once; ``[DONE]`` and whatever is
not JSON pass unchanged; an event it cannot read passes unchanged rather than being lost.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.engines import sse
from narwhal.request.migration.seen import Seen

_DONE = b"[DONE]"


def _frame(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _anthropic(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class Splice:
    """Rewrites one continuation leg's spans (OpenAI's endpoints; module docstring)."""

    __slots__ = ("_id_key", "_id", "_created", "_before", "_prompt", "_chat")

    def __init__(self, kind: str, seen: Seen, prompt_tokens: int | None) -> None:
        self._id_key = "request_id" if kind == "generate" else "id"
        self._id, self._created = seen.id, seen.created
        self._before = seen.tokens  # generated before this leg
        self._prompt = prompt_tokens  # the original prompt's, when a prefill said it
        self._chat = kind == "chat"

    def __call__(self, span: bytes) -> bytes:
        out: list[bytes] = []
        for event in sse.split_events(span):
            data = sse.event_data(event)
            obj = None
            if data is not None and data != _DONE:
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    obj = None
            if not isinstance(obj, dict):
                out.append(event + b"\n\n")
                continue
            if self._chat and _drop_role(obj):
                continue
            self._rewrite(obj)
            out.append(_frame(obj))
        return b"".join(out)

    def _rewrite(self, obj: dict[str, Any]) -> None:
        _only_the_clients(obj)
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    _only_the_clients(choice)
        if self._id is not None and self._id_key in obj:
            obj[self._id_key] = self._id
        if self._created is not None and "created" in obj:
            obj["created"] = self._created
        usage = obj.get("usage")
        if isinstance(usage, dict):
            count_all(usage, self._before, self._prompt)


def count_all(usage: dict[str, Any], before: int, prompt: int | None) -> None:
    """A continuation's ``usage`` (OpenAI's keys) made the whole stream's: the original prompt,
    every generated token. Without the original prompt's count, the continuation's prompt less
    the output it carried stands for it."""
    done, asked = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if type(done) is not int or type(asked) is not int:
        return
    if prompt is None:
        prompt = max(asked - before, 0)
    usage["prompt_tokens"], usage["completion_tokens"] = prompt, before + done
    usage["total_tokens"] = prompt + before + done


_CONTINUATIONS_OWN = ("prompt_token_ids", "prompt_text")  # of the continuation's prompt, not the client's


def _only_the_clients(obj: dict[str, Any]) -> None:
    """What the engine says of the continuation's own prompt (its token ids, its text: the
    client's prompt and the output so far) is null, as an unbroken stream's later chunks have it."""
    for key in _CONTINUATIONS_OWN:
        if obj.get(key) is not None:
            obj[key] = None


def _drop_role(obj: dict[str, Any]) -> bool:
    """Chat's opening chunk (``role``, empty content, maybe the prompt's ids) is dropped; a role
    that came with output loses the role only. True: drop the event."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return False
    del delta["role"]
    obj.pop("prompt_token_ids", None)
    rest = {k: v for k, v in delta.items() if v not in ("", None, [])}
    return not rest and choices[0].get("finish_reason") is None


class MessagesSplice:
    """A Messages stream continued in the chat form: chat chunks in, Anthropic events out."""

    __slots__ = ("_block", "_before", "_prompt", "_finish", "_stop", "_closed")

    def __init__(self, seen: Seen, prompt_tokens: int | None) -> None:
        self._block = seen.block
        self._before = seen.tokens
        self._prompt = prompt_tokens
        self._finish: str | None = None
        self._stop: Any = None
        self._closed = False  # content_block_stop and message_delta went out

    def __call__(self, span: bytes) -> bytes:
        out: list[bytes] = []
        for event in sse.split_events(span):
            data = sse.event_data(event)
            if data == _DONE:
                out.append(self._close(None) + _anthropic("message_stop", {"type": "message_stop"}))
                continue
            try:
                obj = orjson.loads(data) if data is not None else None
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                out.append(event + b"\n\n")  # a comment (heartbeat) or what could not be read
                continue
            out.append(self._chunk(obj))
        return b"".join(out)

    def _chunk(self, obj: dict[str, Any]) -> bytes:
        choices = obj.get("choices")
        if not choices:  # the usage chunk: the message's end, as vLLM's converter writes it
            usage = obj.get("usage")
            return self._close(usage if isinstance(usage, dict) else None)
        choice = choices[0] if isinstance(choices[0], dict) else {}
        if choice.get("finish_reason") is not None:
            self._finish, self._stop = choice["finish_reason"], choice.get("stop_reason")
        text = (choice.get("delta") or {}).get("content")
        if not isinstance(text, str) or not text:
            return b""
        delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}, "index": self._block}
        return _anthropic("content_block_delta", delta)

    def _close(self, usage: dict[str, Any] | None) -> bytes:
        if self._closed:
            return b""
        self._closed = True
        counted = dict(usage) if usage is not None else {"prompt_tokens": 0, "completion_tokens": 0}
        count_all(counted, self._before, self._prompt)
        reason, sequence = _stop_reason(self._finish, self._stop)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": {"input_tokens": counted.get("prompt_tokens", 0),
                           "output_tokens": counted.get("completion_tokens", 0)}}
        block_stop = {"type": "content_block_stop", "index": self._block}
        return _anthropic("content_block_stop", block_stop) + _anthropic("message_delta", delta)


def _stop_reason(finish: str | None, stop: Any) -> tuple[str, str | None]:
    """vLLM's mapping of a chat finish reason to Anthropic's stop reason and stop sequence."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None
