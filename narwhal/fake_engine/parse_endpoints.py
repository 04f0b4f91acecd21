"""Reading ``/v1/messages``, ``/v1/responses`` and ``/inference/v1/generate`` requests as vLLM does.

The fields and refusals that matter to a router (vLLM's `vllm/entrypoints/` for each route): Messages need ``messages``
and a positive ``max_tokens``; Responses need ``input`` and read ``max_output_tokens`` and the
body's ``request_id``; generate needs ``token_ids`` and a ``sampling_params`` object whose
``max_tokens`` bounds the output and refuses ``min_tokens > max_tokens``, and, like completions,
``stream_options`` without ``stream: true``. Prompt tokens are whitespace words (token ids count
one each), as in ``parse``.

Invariant: as ``parse.parse_request`` — returns a request generation can trust, or raises
``RequestError`` with vLLM's status; records and holds nothing.
"""

from __future__ import annotations

from typing import Any

from narwhal.fake_engine.parse import (
    ParsedRequest,
    RequestError,
    check_context,
    count_prompt_tokens,
    detect_phase,
    int_field,
    model_check_error,
    parse_faults,
    resolve_model,
    validation_error,
)


def _words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(len(p["text"].split()) for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _messages(body: dict[str, Any]) -> tuple[int | None, int]:
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError(400, "messages must contain at least one item")
    limit = int_field(body, "max_tokens")
    if limit is None or limit <= 0:
        raise validation_error("max_tokens", "value_error", "Value error, max_tokens must be positive", limit)
    prompt = count_prompt_tokens(body, True) + _words(body.get("system"))
    return limit, prompt


def _responses(body: dict[str, Any]) -> tuple[int | None, int]:
    items = body.get("input")
    if not isinstance(items, str | list):
        raise RequestError(400, "`input` must be a string or a list of input items.")
    words = _words(body.get("instructions"))
    if isinstance(items, str):
        words += _words(items)
    else:
        words += sum(_words(i.get("content")) for i in items if isinstance(i, dict))
    return int_field(body, "max_output_tokens"), max(words, 1)


def _generate(body: dict[str, Any]) -> tuple[int | None, int]:
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(400, "`token_ids` must be a list of integers.")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise RequestError(400, "`sampling_params` is required.")
    limit = int_field(params, "max_tokens")
    low = int_field(params, "min_tokens")
    if low is not None and limit is not None and low > limit:
        raise RequestError(400, f"min_tokens must be less than or equal to max_tokens={limit}, got {low}.")
    if body.get("stream_options") and not body.get("stream"):  # vLLM's validator
        raise model_check_error("Stream options can only be defined when `stream=True`.", "stream_options")
    return limit, max(len(ids), 1)


_READERS = {"messages": _messages, "responses": _responses, "generate": _generate}


def parse_endpoint_request(body: Any, kind: str, models: list[str], max_model_len: int = 8192,
                           current: bool = True) -> ParsedRequest:
    """Validate like vLLM; raise ``RequestError`` with the status vLLM would answer."""
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    faults = parse_faults(body)
    model = resolve_model(body, models)
    limit, prompt = _READERS[kind](body)
    limit = check_context(limit, prompt, max_model_len, current, generate=kind == "generate")
    kv = body.get("kv_transfer_params")
    rid = body.get("request_id")
    options = body.get("stream_options") if kind == "generate" else None  # generate honours it (0.33)
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return ParsedRequest(
        chat=False, phase=detect_phase(body), model=model, stream=body.get("stream") is True,
        include_usage=include_usage, max_tokens=limit, prompt_tokens=prompt,
        kv_params=kv if isinstance(kv, dict) else None, faults=faults, kind=kind,
        request_id=rid if isinstance(rid, str) else None,
    )
