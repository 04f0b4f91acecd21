"""Where a request's output starts: 0, or past the output it asks the engine to continue.

A router that moves a stream to another engine mid-way (docs/behaviour.md "Migration") asks
vLLM to continue the output so far: chat with the text so far as a final assistant message and
``continue_final_message: true``; completions with the text so far after the prompt; generate
with the generated ids after the prompt's. The fake's output is deterministic — token ``i`` is
the text ``" t{i}"`` (id ``1000 + i`` on generate) — so the output so far names how far it went:
a continuation of ``" t0 t1 t2"`` starts at token 3, and the fake generates exactly the tokens an
unbroken stream would have carried next. That is what makes "every token once, in order"
testable.

Messages are never continued: vLLM's ``/v1/messages`` converts to a chat request with
``add_generation_prompt`` left on and no ``continue_final_message``, so a final assistant
message starts a new turn there (and here: the output starts at 0).

Invariant: reads the body only, never raises on what it finds (a prompt that merely looks like
fake output past its end is read as a continuation: tests never write such prompts).
"""

from __future__ import annotations

import re
from typing import Any

from narwhal.fake_engine.frames_generate import FIRST_ID

_TRAILING_TOKENS = re.compile(r"(?:\s?t\d+)+\Z")
_TOKEN = re.compile(r"t(\d+)")


def _text_run(text: str) -> int:
    """How many of the fake's tokens ``text`` ends with, counting up from ``t0``: 0 if none."""
    if not text or not text[-1].isdigit():  # the usual prompt: no regex search at all
        return 0
    found = _TRAILING_TOKENS.search(text)
    if found is None:
        return 0
    indices = [int(m) for m in _TOKEN.findall(found.group())]
    return _counted_up(indices, 0)


def _counted_up(values: list[Any], first: int) -> int:
    """The length of the tail of ``values`` that reads ``first, first + 1, …`` up to its end: the
    last value names it (anything before that tail is prompt)."""
    if not values or not isinstance(values[-1], int):
        return 0
    k = values[-1] - first + 1
    if k <= 0 or k > len(values):
        return 0
    return k if values[-k:] == list(range(first, first + k)) else 0


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def start_of(kind: str, body: dict[str, Any]) -> int:
    """The index of the first token this request generates (module docstring)."""
    if kind == "chat":
        messages = body.get("messages")
        if body.get("continue_final_message") is not True or not isinstance(messages, list) or not messages:
            return 0
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return 0
        return _text_run(_content_text(last.get("content")))
    if kind == "completions":
        prompt = body.get("prompt")
        return _text_run(prompt) if isinstance(prompt, str) else 0
    if kind == "generate":
        ids = body.get("token_ids")
        return _counted_up(ids, FIRST_ID) if isinstance(ids, list) else 0
    return 0
