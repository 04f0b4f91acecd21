"""Pre-encoded SSE frames and JSON bodies in vLLM's exact wire shapes.

Why byte templates: the perf suite pushes thousands of streamed requests per second through the
router into a handful of fake engines sharing a small machine. Encoding one JSON object per token
would make the fake, not the router, the bottleneck. Every frame of a request differs from its
neighbours only in the token text and the finish reason, so each request builds a head (id,
created, model) once and every token frame is ``head + token + tail``: three ``bytes`` joined, no
JSON encoding. Token texts (``" t0"``, ``" t1"`` …) contain nothing that needs JSON escaping, and
the model name is escaped once per engine with orjson.

Rare paths (errors, usage, non-streaming bodies) use orjson: they happen once per request.

Invariant: every completion body and frame the fake sends is built here and nowhere else (``emit``
writes them, ``generate`` picks them), so matching vLLM byte for byte is this module's job alone.
It is a leaf: it imports nothing from the rest of the fake.

Shapes follow vLLM's OpenAI server (vLLM's OpenAI server, `vllm/entrypoints/openai/`): completions
frames carry ``text``, ``logprobs``, ``finish_reason``, ``stop_reason`` and ``"usage": null``; chat
frames carry a ``delta`` and are serialized with ``exclude_unset`` so a plain content chunk has no
``stop_reason`` while the final one does.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"

_TOKENS: list[bytes] = []

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def token_text(i: int) -> str:
    """The text of the ``i``-th generated token (``" t{i}"``): needs no JSON escaping."""
    return f" t{i}"


def token_bytes(i: int) -> bytes:
    """``b" t{i}"``, cached: the same few hundred token texts are reused by every request."""
    cache = _TOKENS
    if i >= len(cache):
        cache.extend(f" t{k}".encode() for k in range(len(cache), max(i + 1, 2 * len(cache), 256)))
    return cache[i]


def error_type(status: int) -> str:
    """The error ``type`` vLLM names for an HTTP status (its exception class name)."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    return phrase.replace(" ", "").replace("-", "") + "Error"


def error_object(
    status: int | None,
    message: str,
    *,
    err_type: str | None = None,
    param: str | None = None,
    flat: bool = False,
) -> dict[str, Any]:
    """vLLM's error body: nested ``{"error": {...}}`` today, flat ``{"object": "error"}`` in ≤0.9."""
    etype = err_type or error_type(status if status is not None else 500)
    if flat:
        return {"object": "error", "message": message, "type": etype, "param": param, "code": status}
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def error_event(status: int | None, message: str, *, flat: bool = False) -> bytes:
    """An in-stream error as one SSE ``data:`` frame, without the ``[DONE]`` that follows it."""
    return b"data: " + orjson.dumps(error_object(status, message, flat=flat)) + b"\n\n"


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` as a stream chunk dumps it (unset fields left out).

    ``prompt_tokens_details`` appears only when some prompt tokens were cached: vLLM with
    ``--enable-prompt-tokens-details`` sets it on ``if enable and num_cached_tokens``, so a miss
    reports no details at all, not ``cached_tokens: 0``.
    """
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


class ModelTemplates:
    """Per-engine, per-model constant parts of every frame (the model name escaped once)."""

    __slots__ = ("model", "_model_json")

    def __init__(self, model: str) -> None:
        self.model = model
        self._model_json = orjson.dumps(model)

    @property
    def model_json(self) -> bytes:
        """The model name as a JSON string, escaped once per engine and model."""
        return self._model_json

    def frames(self, chat: bool, rid: str, created: int, shape: ChunkShape | None = None) -> StreamFrames:
        """The frames of one chat or completions response: its head (id, created, model) built once,
        its choices and trailing keys as ``shape`` (the release, the continuous usage) says."""
        common = b'{"id":' + orjson.dumps(rid) + b',"object":'
        common += b'"chat.completion.chunk"' if chat else b'"text_completion"'
        common += b',"created":' + str(created).encode() + b',"model":' + self._model_json
        shape = shape or ChunkShape()
        return ChatFrames(common, shape) if chat else CompletionFrames(common, shape)


class ChunkShape:
    """What a release's chunk holds beyond the token, and whether every chunk carries usage.

    0.11 and 0.33 build the same chunk objects but serialize them differently (each release's
    ``protocol.py``): 0.33's choices gained ``weight_versions`` and its chunks ``kv_transfer_params`` (null
    unless the request produced a descriptor, which a decode does not); 0.11's completions are
    dumped without ``exclude_unset``, so every default shows. ``continuous_prompt`` is the prompt's
    token count when ``stream_options.continuous_usage_stats`` asked for usage on every chunk
    (``serve/utils/api_utils.py`` ``should_include_usage``), None otherwise. ``start`` is the
    index of the request's first generated token (a continuation's output so far): the running
    count is this request's, from 1, as vLLM counts it."""

    __slots__ = ("current", "continuous_prompt", "extras", "start")

    def __init__(self, current: bool = True, continuous_prompt: int | None = None, extras: bool | None = None,
                 start: int = 0) -> None:
        self.current = current
        self.start = start
        # 0.33's ``weight_versions`` and chunk ``kv_transfer_params``: not on a real 0.32 engine
        # (seen in the real tier), so from 0.33 on (``release.Release.chunk_extras``).
        self.extras = current if extras is None else extras
        self.continuous_prompt = continuous_prompt


class StreamFrames:
    """The SSE frames of one streamed response. Subclasses fill in the chat/completions shapes.

    A token frame is ``head + token + tail``; with continuous usage the tail is split around the
    running usage object (``_choice_end`` … ``_chunk_end``), which the running count makes
    per-token anyway."""

    __slots__ = ("_common", "_head", "_tail", "_tail_length", "_tail_stop", "_shape", "_ends")

    def __init__(self, common: bytes, shape: ChunkShape | None = None) -> None:
        self._common = common
        self._shape = shape or ChunkShape()
        self._head = b""
        self._tail = b""
        self._tail_length = b""
        self._tail_stop = b""
        self._ends: dict[str | None, bytes] = {}  # finish reason -> the choice's end, before usage

    def _set_choice_ends(self, ends: dict[str | None, bytes]) -> None:
        """The choice's end per finish reason (None: a plain token); the tails follow from them."""
        self._ends = ends
        self._tail, self._tail_length, self._tail_stop = (
            ends[None] + self._chunk_end(), ends["length"] + self._chunk_end(), ends["stop"] + self._chunk_end())

    def _chunk_end(self, usage: bytes | None = None) -> bytes:
        """What follows the choices: the release's trailing keys, the usage object if any."""
        raise NotImplementedError

    def _usage_json(self, completion_tokens: int) -> bytes:
        """The running usage object of a continuous-usage chunk, as the release dumps it."""
        raise NotImplementedError

    def _with_usage(self, head: bytes, finish: str | None, completion_tokens: int) -> bytes:
        assert self._shape.continuous_prompt is not None
        return head + self._ends[finish] + self._chunk_end(self._usage_json(completion_tokens))

    def reasoning(self, i: int) -> bytes:
        """Token ``i`` as reasoning (a thinking model's); only chat streams carry it."""
        return self.token(i)

    def token(self, i: int) -> bytes:
        """The frame of generated token ``i``: head + token + tail, no JSON encoding."""
        if self._shape.continuous_prompt is None:
            return self._head + token_bytes(i) + self._tail
        return self._with_usage(self._head + token_bytes(i), None, i + 1 - self._shape.start)

    def last_token(self, i: int, finish_reason: str) -> bytes:
        """The frame of the final token, carrying ``finish_reason`` (``"length"`` or ``"stop"``)."""
        if self._shape.continuous_prompt is None:
            tail = self._tail_length if finish_reason == "length" else self._tail_stop
            return self._head + token_bytes(i) + tail
        return self._with_usage(self._head + token_bytes(i), finish_reason, i + 1 - self._shape.start)

    def empty_stop(self) -> bytes:
        """An immediate end of sequence: no text, ``finish_reason: "stop"``."""
        if self._shape.continuous_prompt is None:
            return self._head + self._tail_stop
        return self._with_usage(self._head, "stop", 0)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The usage-only chunk (``choices: []``) that ``include_usage`` asks for."""
        usage = orjson.dumps(usage_object(prompt_tokens, completion_tokens, cached_tokens))
        return b"data: " + self._common + b',"choices":[],"usage":' + usage + b"}\n\n"

    def role(self) -> bytes:
        """The chunk before the first token (chat's role delta); completions send none."""
        return b""

    def heartbeat(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """What keeps the stream alive while no token comes (first-token delay, silence)."""
        raise NotImplementedError

    def body(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The whole (non-streaming) answer, without ``kv_transfer_params`` decided yet; the
        cached prompt tokens in the endpoint's own usage field."""
        raise NotImplementedError

    # -- a stream's fixed parts: chat and completions here; each endpoint's frames override --

    def opening(self, prompt_tokens: int) -> bytes:
        """What goes out before any token (after the KV pull)."""
        return self.role()

    def terminal_first(self) -> bytes:
        """The terminal event with no output before it (the ``done_before_token`` fault)."""
        return DONE

    def empty_end(self, prompt_tokens: int, include_usage: bool, cached_tokens: int = 0) -> bytes:
        """An immediate end of sequence: a valid, empty answer."""
        usage = self.usage(prompt_tokens, 0, cached_tokens) if include_usage else b""
        return self.empty_stop() + usage + DONE

    def end(
        self, prompt_tokens: int, completion_tokens: int, include_usage: bool, finish_reason: str,
        cached_tokens: int = 0,
    ) -> bytes:
        """What follows the last token: the usage chunk if asked for, then ``[DONE]``."""
        usage = self.usage(prompt_tokens, completion_tokens, cached_tokens) if include_usage else b""
        return usage + DONE

    def error(self, code: int | None, message: str, flat: bool) -> bytes:
        """An error inside the 200 stream, as the endpoint sends it (vLLM: then ``[DONE]``)."""
        return error_event(code, message, flat=flat) + DONE


class CompletionFrames(StreamFrames):
    """``/v1/completions`` frames: a ``text`` per chunk (``openai/completion/serving.py``).

    0.11 dumps every field (``"usage":null`` on each chunk); 0.33 dumps the fields it set, which
    are every choice field and ``kv_transfer_params``, but not ``usage`` unless it is continuous."""

    __slots__ = ()

    def __init__(self, common: bytes, shape: ChunkShape | None = None) -> None:
        super().__init__(common, shape)
        self._head = b"data: " + common + b',"choices":[{"index":0,"text":"'
        rest = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null'
        rest += b',"weight_versions":null}]' if self._shape.extras else b"}]"
        self._set_choice_ends({
            f: b'","logprobs":null,"finish_reason":' + (b'"%s"' % f.encode() if f else b"null") + rest
            for f in (None, "length", "stop")})

    def _chunk_end(self, usage: bytes | None = None) -> bytes:
        if self._shape.current:
            tail = b',"kv_transfer_params":null}\n\n' if self._shape.extras else b"}\n\n"
            return (b',"usage":' + usage if usage else b"") + tail
        return b',"usage":' + (usage or b"null") + b"}\n\n"

    def _usage_json(self, completion_tokens: int) -> bytes:
        prompt = self._shape.continuous_prompt or 0
        usage = b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d' % (
            prompt, prompt + completion_tokens, completion_tokens)
        return usage + (b"}" if self._shape.current else b',"prompt_tokens_details":null}')

    def heartbeat(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """A usage-only chunk: completions have no role delta to repeat."""
        # Completions have no role delta: a usage-only chunk is their metadata event.
        return self.usage(prompt_tokens, completion_tokens)


class ChatFrames(StreamFrames):
    """``/v1/chat/completions`` frames: a ``delta`` per chunk, the role delta first.

    Both releases dump with ``exclude_unset``: a plain chunk has ``token_ids`` but no
    ``stop_reason``, the last one both; 0.33 adds ``weight_versions`` to the last choice and
    ``kv_transfer_params`` to every content chunk (``openai/chat_completion/serving.py``)."""

    __slots__ = ("_role_choice", "_role_only")

    def __init__(self, common: bytes, shape: ChunkShape | None = None) -> None:
        super().__init__(common, shape)
        choices = b"data: " + common + b',"choices":[{"index":0,'
        self._head = choices + b'"delta":{"content":"'
        last = b',"stop_reason":null,"token_ids":null' + (b',"weight_versions":null' if self._shape.extras else b"")
        self._set_choice_ends({
            None: b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]',
            "length": b'"},"logprobs":null,"finish_reason":"length"' + last + b"}]",
            "stop": b'"},"logprobs":null,"finish_reason":"stop"' + last + b"}]",
        })
        self._role_choice = (
            choices + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
        )
        self._role_only = (
            choices + b'"delta":{"role":"assistant"},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def _chunk_end(self, usage: bytes | None = None) -> bytes:
        usage_part = b',"usage":' + usage if usage else b""
        return usage_part + (b',"kv_transfer_params":null}\n\n' if self._shape.extras else b"}\n\n")

    def reasoning(self, i: int) -> bytes:
        """Token ``i`` as a reasoning delta: ``delta.reasoning`` from 0.2x on
        (``generate/base/protocol.py``), ``delta.reasoning_content`` in 0.11."""
        key = b'"reasoning":"' if self._shape.current else b'"reasoning_content":"'
        head = self._head.replace(b'"delta":{"content":"', b'"delta":{' + key)
        if self._shape.continuous_prompt is None:
            return head + token_bytes(i) + self._tail
        return self._with_usage(head + token_bytes(i), None, i + 1 - self._shape.start)

    def _usage_json(self, completion_tokens: int) -> bytes:
        prompt = self._shape.continuous_prompt or 0
        usage = b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d' % (
            prompt, prompt + completion_tokens, completion_tokens)
        return usage + (b',"completion_tokens_details":null}' if self._shape.current else b"}")

    def role(self) -> bytes:
        """The role delta with empty content that opens every chat stream; the first chunk also
        carries the (unrequested, so null) prompt token ids, and on 0.33 the prompt text."""
        continuous = self._shape.continuous_prompt is not None
        usage = b',"usage":' + self._usage_json(0) if continuous else b""
        ids = b',"prompt_token_ids":null' + (b',"prompt_text":null' if self._shape.current else b"")
        return self._role_choice + usage + ids + b"}\n\n"

    def heartbeat(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """A role-only delta: carries no content, so a client's text is unchanged."""
        return self._role_only


def completion_body(
    chat: bool,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` / ``chat.completion`` object (without kv params)."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    usage: dict[str, Any] = usage_object(prompt_tokens, completion_tokens, cached_tokens)
    usage.setdefault("prompt_tokens_details", None)  # a full dump of UsageInfo: null when unset
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
