"""The ``data:``-framed endpoints that end with ``[DONE]``: completions, chat, and vLLM's generate.

Completions and chat keep exactly the rules they had (``narwhal.engines.sse`` classifies their
events, ``narwhal.engines.connector`` rewrites their prefill); they are descriptions here so the
request path asks every endpoint the same questions. ``/inference/v1/generate`` is vLLM's
tokens-in route (``vllm/entrypoints/serve/disagg``): ``token_ids`` and a ``sampling_params``
object in, chat-style frames whose choices carry ``token_ids`` out, ``[DONE]`` at the end, errors
as ``data: {"error": ...}`` (docs/behaviour.md "The other P/D endpoints").
"""

from __future__ import annotations

from typing import Any

from narwhal.engines import connector, sse
from narwhal.engines.dialects.base import Dialect, Kind, bad, content_text, is_int, json_of
from narwhal.engines.sse import event_data

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"


def _check_prompt(prompt: Any) -> None:
    if type(prompt) is str:  # exact types: orjson's values are never subclasses
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(is_int(p) for p in prompt):
            return
        if all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
            return
    raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of lists of ids")


def _ids_text(ids: list[Any], limit: int) -> str:
    # Each id takes at least two characters with its separator: limit ids are always enough.
    return " ".join(map(str, ids[:limit]))



class Completions(Dialect, endpoint=COMPLETIONS, prompt_fields=("prompt",)):
    """Completions and chat: the rules of docs/behaviour.md "The request path"–"Failure semantics"
    as ``engines.sse`` and ``connector`` hold them.
    """

    __slots__ = ()

    def check(self, body: dict[str, Any]) -> None:
        """``prompt`` present: a string, strings, token ids or lists of ids."""
        if "prompt" not in body:
            raise bad("'prompt' is required")
        _check_prompt(body["prompt"])

    def affinity_text(self, body: dict[str, Any], limit: int) -> str | None:
        """``prompt``: a string, the first of a list of strings, or token ids as decimal text."""
        prompt = body.get("prompt")
        if type(prompt) is str:
            return prompt
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str):
                return first
            return _ids_text(first if isinstance(first, list) else prompt, limit)
        return ""

    def full_report(self, body: dict[str, Any]) -> dict[str, Any]:
        """``vllm_xargs.kv_cache_report_mode = "full"`` beside the client's own ``vllm_xargs``
        (vLLM hands them to the engine as ``SamplingParams.extra_args``)."""
        xargs = body.get("vllm_xargs")
        return {**body, "vllm_xargs": {**(xargs if isinstance(xargs, dict) else {}), "kv_cache_report_mode": "full"}}

    def token_ids(self, body: dict[str, Any]) -> list[int] | dict[str, Any] | None:
        """A string prompt's ``/tokenize`` body (special tokens as the request asks, vLLM's
        default on); a prompt of token ids (or a list of them: the first) is its ids."""
        prompt = body.get("prompt")
        if type(prompt) is str:
            return {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        if isinstance(prompt, list) and prompt:
            ids = prompt[0] if isinstance(prompt[0], list) else prompt
            if all(is_int(t) for t in ids):
                return ids
        return None

    def probe_body(self, model: str, prompt: str) -> dict[str, Any]:
        """A two-token completion of ``prompt``."""
        return {"model": model, "prompt": prompt, "max_tokens": 2}

    def prefill_body(self, body: dict[str, Any], request_id: str, crossed: bool) -> dict[str, Any]:
        """``connector.prefill_body``: the rewrite of docs/behaviour.md "The request path"."""
        return connector.prefill_body(body, crossed=crossed)

    def release_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """``connector.release_body``."""
        return connector.release_body(body, descriptor)

    # The functions themselves, not methods around them: on the chat path, the probe runs for
    # every span after the first token and must cost what it did before descriptions existed.
    may_end = staticmethod(sse.may_end_stream)
    classify = staticmethod(sse.classify)

    def clean_end(self, span: bytes) -> int:
        """The whole span when it ends with ``[DONE]`` (``sse.ends_with_done``), else -1."""
        return len(span) if sse.ends_with_done(span) else -1


class Chat(Completions, endpoint=CHAT, prompt_fields=("messages",)):
    """``/v1/chat/completions``: completions' stream rules, the prompt in ``messages``."""

    __slots__ = ()

    def check(self, body: dict[str, Any]) -> None:
        """``messages`` a list of objects, checked without a Python step per message."""
        messages = body.get("messages")
        # Element types counted in C (exact: decoded JSON), not a Python step per message.
        if type(messages) is not list or list(map(type, messages)).count(dict) != len(messages):
            raise bad("'messages' must be a list of objects")

    def affinity_text(self, body: dict[str, Any], limit: int) -> str | None:
        """Each message's role and text content, until ``limit`` characters are in hand."""
        parts: list[str] = []
        size = 0
        for message in body.get("messages") or ():
            role = message.get("role")
            piece = f"{role if isinstance(role, str) else ''}\n{content_text(message.get('content'), 'text')[:limit]}\n"
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        return "".join(parts)

    def answer_span(self, body: dict[str, Any], limit: int) -> tuple[int, int] | None:
        """The last ``assistant`` message a later message follows, as :meth:`affinity_text` writes it."""
        messages = body.get("messages") or ()
        last = len(messages) - 1
        size = 0
        span = None
        for i, message in enumerate(messages):
            role = message.get("role")
            text = content_text(message.get("content"), "text")[:limit]
            n = len(role if isinstance(role, str) else "") + len(text) + 2  # "role\ntext\n"
            if i < last and role == "assistant":
                span = (size, size + n)
            size += n
            if size >= limit:
                break
        return span

    def token_ids(self, body: dict[str, Any]) -> list[int] | dict[str, Any] | None:
        """The ``/tokenize`` body of the messages with what shapes the chat template's output
        (vLLM's ``TokenizeChatRequest``: its defaults are the chat endpoint's)."""
        out = {key: body[key] for key in _CHAT_TEMPLATE_FIELDS if key in body}
        out["messages"] = body.get("messages")
        return out

    def probe_body(self, model: str, prompt: str) -> dict[str, Any]:
        """A two-token chat of one user message."""
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}


# What vLLM's chat template rendering reads beside the messages (``TokenizeChatRequest`` takes each).
_CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                         "chat_template_kwargs", "tools", "documents", "mm_processor_kwargs")

# Removed from the prefill's sampling_params so its single token never ends the request early.
_PREFILL_SAMPLING_DROPPED = ("min_tokens", "stop", "stop_token_ids")


class Generate(Completions, endpoint=GENERATE, prompt_fields=("token_ids",)):
    """``/inference/v1/generate``: the prefill rewrite lives inside ``sampling_params``."""

    __slots__ = ()

    def check(self, body: dict[str, Any]) -> None:
        """Non-empty ``token_ids``, a ``sampling_params`` object, and ``n`` at most 1 (one stream to relay)."""
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
            raise bad("'token_ids' must be a non-empty list of token ids")
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            raise bad("'sampling_params' must be an object")
        limit = params.get("max_tokens")
        if limit is not None and (not is_int(limit) or limit < 0):
            raise bad("'sampling_params.max_tokens' must be an integer >= 0")
        n = params.get("n")
        if n is not None and (not is_int(n) or n > 1):
            raise bad("'sampling_params.n' > 1 is not supported by disaggregated serving")

    def full_report(self, body: dict[str, Any]) -> dict[str, Any]:
        """``kv_cache_report_mode = "full"`` in ``sampling_params.extra_args``."""
        params = body.get("sampling_params")
        params = dict(params) if isinstance(params, dict) else {}
        extra = params.get("extra_args")
        params["extra_args"] = {**(extra if isinstance(extra, dict) else {}), "kv_cache_report_mode": "full"}
        return {**body, "sampling_params": params}

    def token_ids(self, body: dict[str, Any]) -> list[int] | dict[str, Any] | None:
        """The prompt's ids, as the client sent them."""
        ids = body.get("token_ids")
        return ids if isinstance(ids, list) else None

    def affinity_text(self, body: dict[str, Any], limit: int) -> str | None:
        """The prompt's ids joined by spaces, no more of them than ``limit`` characters need."""
        ids = body.get("token_ids")
        if not isinstance(ids, list):
            return ""
        # Each id takes at least two characters with its separator: no more are needed.
        return " ".join(map(str, ids[: limit // 2 + 1]))

    def prefill_body(self, body: dict[str, Any], request_id: str, crossed: bool) -> dict[str, Any]:
        """One token in ``sampling_params``, with what could end it early dropped; not streamed."""
        out = dict(body)
        out.pop("stream_options", None)  # refused by vLLM when stream is false
        params = dict(out.get("sampling_params") or {})
        for key in _PREFILL_SAMPLING_DROPPED:
            params.pop(key, None)
        params["max_tokens"] = 1
        out["sampling_params"] = params
        out["stream"] = False
        connector.ask_for_handoff(out, crossed)
        return out

    def release_body(self, body: dict[str, Any], request_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """One token, not streamed, the descriptor in; what could end it early or be refused
        (``min_tokens``, ``stop``, ``stop_token_ids``) dropped: a release the consumer refuses
        frees nothing."""
        out = dict(body)
        out.pop("stream_options", None)
        params = dict(out.get("sampling_params") or {})
        for key in _PREFILL_SAMPLING_DROPPED:
            params.pop(key, None)
        params["max_tokens"] = 1
        out["sampling_params"] = params
        out["stream"] = False
        out["kv_transfer_params"] = descriptor
        return out

    def classify(self, event: bytes) -> tuple[Kind, dict[str, Any] | None]:
        """``sse.classify``, and a chunk whose choices carry ``token_ids`` is output."""
        kind, err = sse.classify(event)
        if kind is not Kind.METADATA or b'"token_ids"' not in (event_data(event) or b""):
            return kind, err
        # sse.classify knows text, deltas and finish_reason; generate's output is token ids.
        obj = json_of(event)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if isinstance(choices, list) and any(isinstance(c, dict) and c.get("token_ids") for c in choices):
            return Kind.TOKEN, None
        return Kind.METADATA, None


# The error shape of a route without a dialect of its own (passthrough, the guard's 404/405/413):
# OpenAI's, as on completions.
DEFAULT_ERRORS: Dialect = Completions()
