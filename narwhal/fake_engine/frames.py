"""Which frames a request's answer is written with, by endpoint (one object per response).

Completions and chat come from ``chunks`` (per-model templates); Messages, Responses and generate
from their own modules. The order of events is ``generate.py``'s, the bytes are the frames'.
Invariant: imports only the frame modules, which import only ``chunks``: no cycle.
"""

from __future__ import annotations

from narwhal.fake_engine.chunks import ChunkShape, ModelTemplates, StreamFrames
from narwhal.fake_engine.frames_generate import GenerateFrames
from narwhal.fake_engine.frames_messages import MessagesFrames
from narwhal.fake_engine.frames_responses import ResponsesFrames

# vLLM's response-id prefix per endpoint; responses take the body's request_id as it is.
ID_PREFIX = {"completions": "cmpl-", "chat": "chatcmpl-", "messages": "chatcmpl-", "generate": "generate-tokens-"}


def frames_for(
    kind: str, templates: ModelTemplates, rid: str, created: int, max_tokens: int | None,
    shape: ChunkShape | None = None,
) -> StreamFrames:
    """The frames object one response of endpoint ``kind`` is written with; ``shape`` (the
    release's chunk keys, continuous usage) applies to chat and completions, the OpenAI
    endpoints that have it."""
    if kind == "messages":
        return MessagesFrames(templates.model_json, rid)
    if kind == "responses":
        return ResponsesFrames(templates.model, rid, created, max_tokens, shape.extras if shape is not None else True)
    if kind == "generate":
        return GenerateFrames(rid)
    return templates.frames(kind == "chat", rid, created, shape)
