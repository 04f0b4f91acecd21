"""What every endpoint's stream description shares: the interface, OpenAI's error shapes, helpers.

A :class:`Dialect` says, for one P/D endpoint, everything the request path must know that differs
between endpoints (docs/behaviour.md "The other P/D endpoints"): the prefill, decode and release
bodies, the admission checks and the affinity text, which events are generated output, the valid
terminal event, how an in-stream error is recognised and its status, and how the router's own errors
are shaped for that endpoint's clients. The request path (``narwhal.engines.decode``,
``narwhal.request``) is one path for all endpoints and asks its dialect; no endpoint has a copy of
it.

Why byte probes: after the first token, the relay looks at a span only when ``may_end`` says
its bytes could hold the terminal event or an error — a ``in`` test or two on bytes, no parse
— so a long stream costs the same per chunk on every endpoint (docs/behaviour.md "Failure semantics", ARCHITECTURE's
hot path).

Invariant: every method is pure (no I/O, no clock); ``classify`` returns an error object
normalised to ``{"code": int | None, "message": str}`` so ``failures.stream_error`` maps it
alike for every endpoint.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.engines.sse import DONE_EVENT, Kind, event_data
from narwhal.errors import NarwhalError, RequestError
from narwhal.reasons import Reason

__all__ = ["Dialect", "Kind", "bad", "event_name", "is_int", "json_of", "status_of_code", "turns_text"]


def bad(message: str, param: str | None = None) -> RequestError:
    """The 400 an admission check raises (reason ``bad_request``), naming the field at fault."""
    error = RequestError(message, reason=Reason.BAD_REQUEST)
    error.param = param
    return error


def is_int(value: Any) -> bool:
    """An int and not a bool: decoded JSON has exact types, so one ``type`` test says it."""
    return type(value) is int


MAX_TOKENS_COUNTED = 1 << 32  # a token count at or past this is no count an engine could mean


def token_count(value: Any) -> int | None:
    """``value`` when it is a token count an engine could report: an int (bools are not) in
    ``[0, 2^32)``; anything else is unknown (a negative count stopped a worker's
    metric flush for good)."""
    return value if type(value) is int and 0 <= value < MAX_TOKENS_COUNTED else None


def event_name(event: bytes) -> bytes | None:
    """The ``event:`` field of one SSE event (vLLM writes it first), or None."""
    if not event.startswith(b"event:"):
        return None
    line = event.split(b"\n", 1)[0][6:]
    return line.strip()


def json_of(event: bytes) -> Any:
    """The event's data parsed as JSON; None for comments, ``[DONE]`` and non-JSON data."""
    data = event_data(event)
    if data is None:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def content_text(content: Any, part_type: str | None = None) -> str:
    """A message's prompt text: a string as is, or its content parts' ``text`` joined (only parts of
    ``part_type`` when given: chat's image and audio parts also carry fields, never prompt text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
                       and (part_type is None or part.get("type") == part_type))
    return ""


def turns_text(head: str, turns: Any, limit: int) -> str:
    """``head``, then each turn (an object with ``role`` and ``content``) as ``role: text``, a line
    each, until ``limit`` characters are in hand: Messages' and Responses' affinity text."""
    parts = [head]
    size = len(head)
    for turn in turns if isinstance(turns, list) else ():
        if size >= limit:
            break
        if isinstance(turn, dict):
            part = f"{turn.get('role', '')}: {content_text(turn.get('content'))}"
            parts.append(part)
            size += len(part)
    return "\n".join(p for p in parts if p)


def turns_answer(head: str, turns: Any, limit: int) -> tuple[int, int] | None:
    """Where the last ``assistant`` turn that a later turn follows sits in
    ``turns_text(head, turns, limit)``: its (start, end) characters; None: there is none."""
    if not isinstance(turns, list):
        return None
    at = len(head) + 1 if head else 0  # where the next part starts ("\n" between parts)
    size = len(head)
    span = None
    last = len(turns) - 1
    for i, turn in enumerate(turns):
        if size >= limit:
            break
        if isinstance(turn, dict):
            n = len(f"{turn.get('role', '')}: {content_text(turn.get('content'))}")
            if i < last and turn.get("role") == "assistant":
                span = (at, at + n)
            at += n + 1
            size += n
    return span


def status_of_code(code: Any) -> int | None:
    """An error object's ``code`` as an HTTP status when it is one (4xx/5xx), else None (→ 502)."""
    return code if is_int(code) and 400 <= code <= 599 else None


_INHERITED: Any = object()  # a class keyword left out: the parent dialect's value stands


class Dialect:
    """The OpenAI-shaped defaults; each endpoint overrides what differs.

    An endpoint's dialect declares what it is in its class line, ``class Chat(Completions,
    endpoint=CHAT, prompt_fields=("messages",))``: the endpoint and its prompt fields are required
    there, so a dialect without them fails at import, not on its first request."""

    __slots__ = ()

    endpoint = ""
    # The body fields that hold the prompt (the part that grows with it): encoded once and
    # embedded in every engine body as is (``narwhal.request.admission.embed_prompt``).
    prompt_fields: tuple[str, ...] = ()
    terminal = "[DONE]"  # the bare terminal event name, for the done_before_token detail
    terminal_bytes: bytes | None = DONE_EVENT  # what the terminal event is relayed as; None: as received

    def __init_subclass__(cls, *, endpoint: str, prompt_fields: tuple[str, ...], terminal: str = _INHERITED,
                          terminal_bytes: bytes | None = _INHERITED, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not endpoint or not prompt_fields:
            raise TypeError(f"dialect {cls.__name__}: an endpoint and its prompt fields are required")
        cls.endpoint, cls.prompt_fields = endpoint, prompt_fields
        if terminal is not _INHERITED:
            cls.terminal = terminal
        if terminal_bytes is not _INHERITED:
            cls.terminal_bytes = terminal_bytes

    # -- admission ----------------------------------------------------------------------------

    def check(self, body: dict[str, Any]) -> None:
        """Refuse (``RequestError``, 400) a field the router reads that has the wrong type."""

    def affinity_text(self, body: dict[str, Any], limit: int) -> str | None:
        """The prompt text the affinity key is cut from, from its start (at least ``limit``
        characters when the prompt has them); None when the endpoint has no prompt text (no
        affinity key, never a local decode)."""
        return None

    def answer_span(self, body: dict[str, Any], limit: int) -> tuple[int, int] | None:
        """Where the last answer a later turn follows sits in :meth:`affinity_text`'s text (the
        same ``limit``): its (start, end) characters; None: the prompt has no turns (a consumer
        that decoded the turn before holds that answer: it wrote it)."""
        return None

    def full_report(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` asking the engine to publish, as KV-cache events, the cached blocks the request
        reuses (vLLM's ``kv_cache_report_mode = "full"``, 0.26 on; an older release ignores it):
        this endpoint cannot ask, so unchanged."""
        return body

    def token_ids(self, body: dict[str, Any]) -> list[int] | dict[str, Any] | None:
        """The prompt's token ids as the engine will see them: the ids themselves when the body
        carries them, else the ``/tokenize`` body (without ``model``) that gives them, else None
        (this endpoint's prompt is not tokenized here: placement by learned holdings)."""
        return None

    def probe_body(self, model: str, prompt: str) -> dict[str, Any]:
        """A tiny request for ``model`` (two tokens), as the supervisor's probes and preflight send."""
        raise NotImplementedError

    # -- engine bodies --------------------------------------------------------------------------

    def prompt_usage(self, usage: Any) -> tuple[int | None, int | None]:
        """(prompt tokens, cached prompt tokens) of a prefill's ``usage``, each None when absent
        or not an int: here ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` (vLLM
        fills the details with ``--enable-prompt-tokens-details``)."""
        if type(usage) is not dict:  # decoded JSON: exact types
            return None, None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        return token_count(usage.get("prompt_tokens")), token_count(cached)

    def prefill_body(self, body: dict[str, Any], request_id: str, crossed: bool) -> dict[str, Any]:
        """The producer's body: one token, not streamed, the handoff asked for when ``crossed``."""
        raise NotImplementedError

    def decode_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any] | None) -> dict[str, Any]:
        """The client's body plus the validated descriptor, unchanged (none for same-worker)."""
        out = dict(body)
        if descriptor is None:
            out.pop("kv_transfer_params", None)
        else:
            out["kv_transfer_params"] = descriptor
        return out

    def release_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """A one-token decode whose only job is to free the producer's blocks named by ``descriptor``."""
        raise NotImplementedError

    # -- the stream -----------------------------------------------------------------------------

    def may_end(self, span: bytes) -> bool:
        """Cheap byte probe after the first token: could ``span`` hold the end or an error?"""
        return b"[DONE]" in span or b'"error"' in span

    def clean_end(self, span: bytes) -> int:
        """When ``span`` (whole events) is the usual end of a stream — output, then the terminal
        event, no error anywhere — the length of it to relay as is; else -1 (judge each event)."""
        return -1

    def classify(self, event: bytes) -> tuple[Kind, dict[str, Any] | None]:
        """One event's kind, with the normalised error object when it is an error."""
        raise NotImplementedError

    def whole_error(self, data: bytes) -> dict[str, Any] | None:
        """An error reported inside a non-streaming 200 body, normalised; None: a success."""
        return None

    # -- the router's own errors, shaped for this endpoint's clients ---------------------------

    def error_body(self, exc: NarwhalError) -> bytes:
        """The router's own error as this endpoint's clients expect it (here OpenAI's error
        object: ``type`` is the reason, ``code`` the status). The one place an error's shape is
        chosen: a route without a dialect (passthrough, the guard's refusals) answers in
        :data:`~narwhal.engines.dialects.DEFAULT_ERRORS`'s."""
        return orjson.dumps({"error": {"message": exc.message, "type": exc.reason, "param": exc.param,
                                       "code": exc.status}})

    def error_event(self, exc: NarwhalError) -> bytes:
        """The one terminal event that ends a stream whose 200 was already committed."""
        return b"data: " + self.error_body(exc) + b"\n\n"
