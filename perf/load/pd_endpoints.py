"""The load generator's view of the other P/D endpoints (``/v1/messages``, ``/v1/responses``).

Why a module of its own: their frames are ``event: <type>`` events that end with their own
terminal event rather than ``[DONE]``, and the load generator must recognise output and the end
as cheaply as it does for completions (a byte prefix test, no parse after the first token). The
request bodies mirror ``perf.load.generator.Workload``'s: the same prompt and token count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
ENDPOINTS = (MESSAGES, RESPONSES)
# An event starting with one of these ends a valid stream (0.33 ends a Responses stream its
# max_output_tokens cut with response.incomplete, earlier releases with response.completed).
TERMINALS = (b"event: message_stop", b"event: response.completed", b"event: response.incomplete")
_OUTPUT = (b"event: content_block_delta", b"event: response.output_text.delta")


def data(endpoint: str, model: str, prompt: str, tokens: int, stream: bool,
         fault: Mapping[str, Any] | None) -> dict[str, Any]:
    if endpoint == MESSAGES:
        body: dict[str, Any] = {"model": model, "max_tokens": tokens, "stream": stream,
                                "messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"model": model, "max_output_tokens": tokens, "stream": stream, "input": prompt}
    if fault is not None:
        body["narwhal_fake"] = dict(fault)
    return body


def is_output(event: bytes) -> bool:
    return event.startswith(_OUTPUT)
