"""What a stream's client has seen so far, read back from the spans it was sent.

The relay never parses what it passes on (docs/architecture of the relay: no JSON work per
chunk), so a stream that may migrate only keeps the spans its client was sent
(:class:`~narwhal.request.migration.Migration`'s transcript) and reads them here, once, when a cut asks
for a continuation — or a batch at a time when a long stream's spans pile up. Reading is
incremental: :meth:`Seen.absorb` takes the next spans and adds to what it knew.

What it learns: the stream's identity as the client knows it (the response ``id`` and
``created``; generate's ``request_id``; Messages' message id and open text block), the output
so far (its text, and its token ids where the engine sent them), how many tokens that was, and
whether a continuation could be exact at all. It cannot be when the output holds tool-call
deltas, reasoning, or more than one choice: the continuation forms carry text (or ids) of one
choice, and a half-written tool call or a thought re-entered as text would not be the stream the
client was reading. Such a stream ends as it did before migrations existed.

It also learns whether the stream's finish already went out (a ``finish_reason``; Messages: a
``message_delta`` with its ``stop_reason``) and whether its usage did: a stream cut after its
finish is complete, never continued (docs/behaviour.md "Migration"), and only those two facts
are read from the last spans (:meth:`~narwhal.request.migration.transcript.Transcript.tail`)
before a continuation is decided.

Invariant: whatever the spans hold (they came from an engine), absorbing never raises; what it
cannot read leaves the stream marked not continuable, never a wrong continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal.engines import sse

GENERATE_KIND = "generate"
MESSAGES_KIND = "messages"


@dataclass(slots=True)
class Seen:
    """The output a client was sent, as far as the spans absorbed so far tell (module docstring)."""

    kind: str  # "chat", "completions", "generate" or "messages"
    id: str | None = None  # the response id (generate: request_id; messages: the message's id)
    created: int | None = None
    text: list[str] = field(default_factory=list)  # the output's text pieces, in order
    token_ids: list[int] = field(default_factory=list)  # the output's ids, where the engine sent them
    events: int = 0  # events that carried output: a token each, on an engine that streams per step
    usage_tokens: int | None = None  # the last completion_tokens the stream carried (continuous usage)
    block: int = 0  # messages: the index of the text block the output is in
    why_not: str | None = None  # what makes an exact continuation impossible, if anything
    finished: bool = False  # the stream's finish went out (a finish_reason; Messages: a stop_reason)
    usage_sent: bool = False  # the usage chunk (no choices; Messages: the message_delta) went out
    last: dict[str, Any] | None = None  # the last event read that had choices: the usage chunk's model

    @property
    def tokens(self) -> int:
        """Tokens generated so far: the ids when the engine sent them, else its own running count,
        else one per output event (vLLM streams one event per engine step and request)."""
        if self.token_ids:
            return len(self.token_ids)
        if self.usage_tokens is not None:
            return self.usage_tokens
        return self.events

    @property
    def output(self) -> str:
        """The output's text so far."""
        return "".join(self.text)

    def absorb(self, spans: list[bytes]) -> None:
        """Read the next spans the client was sent (whole SSE events, in order)."""
        for span in spans:
            for event in sse.split_events(span):
                try:
                    self._event(event)
                except (TypeError, ValueError, AttributeError, KeyError) as exc:  # an engine's odd shape
                    self.why_not = self.why_not or f"an event could not be read ({type(exc).__name__})"

    def _event(self, event: bytes) -> None:
        data = sse.event_data(event)
        if data is None or data == b"[DONE]":
            return
        obj = orjson.loads(data)
        if not isinstance(obj, dict):
            return
        if self.kind == MESSAGES_KIND:
            self._anthropic(obj)
            return
        if self.id is None:
            self.id = obj.get("request_id") if self.kind == GENERATE_KIND else obj.get("id")
            created = obj.get("created")
            self.created = created if type(created) is int else None
        usage = obj.get("usage")
        if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
            self.usage_tokens = usage["completion_tokens"]
        choices = obj.get("choices")
        if not choices:
            self.usage_sent = self.usage_sent or isinstance(usage, dict)
            return
        self.last = obj
        for choice in choices:
            self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if choice.get("finish_reason") is not None:
            self.finished = True
        if choice.get("index", 0) != 0:
            self.why_not = "more than one choice"
            return
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        if self.kind == "chat":
            delta = choice.get("delta") or {}
            if delta.get("tool_calls") or delta.get("reasoning") or delta.get("reasoning_content"):
                self.why_not = "tool calls or reasoning in the output"
                self.events += 1
                return
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.text.append(text)
            self.events += 1
        elif self.kind == GENERATE_KIND and ids:
            self.events += 1

    def _anthropic(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "message_start":
            self.id = (obj.get("message") or {}).get("id")
        elif kind == "content_block_start":
            block = obj.get("content_block") or {}
            if block.get("type") != "text" or self.text:
                self.why_not = f"a {block.get('type')!r} block in the output"
            self.block = obj.get("index", 0)
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type") != "text_delta":
                self.why_not = f"a {delta.get('type')!r} delta in the output"
            elif delta.get("text"):
                self.text.append(delta["text"])
                self.events += 1
        elif kind == "message_delta":
            if (obj.get("delta") or {}).get("stop_reason") is not None:
                self.finished = self.usage_sent = True
