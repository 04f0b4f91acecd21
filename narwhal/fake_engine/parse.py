"""Reading a completion request the way vLLM's OpenAI server does.

Validation mirrors the errors a router meets in production: vLLM answers an unknown model with
404, ``stream_options`` without ``stream: true`` with 400 (which is why proxies delete it from the
prefill), and ``min_tokens > max_tokens`` with 400 (which is why proxies pop ``min_tokens`` from the
prefill). A router that forgets either rewrite fails against the fake as it would against vLLM.

Phase detection decides which fault spec applies and labels the request records:
``do_remote_decode`` marks a producer prefill, ``do_remote_prefill`` a consumer decode, and a
non-streaming ``max_tokens: 1`` + ``ignore_eos`` request without ``kv_transfer_params`` is the
router's same-engine warm-up prefill (docs/behaviour.md "Prefill").

Invariant: ``parse_request`` either returns a ``ParsedRequest`` that generation can trust as is
(known model, non-negative integer ``max_tokens``, ``kv_params`` a dict or None) or raises
``RequestError`` with vLLM's status; it records, counts and holds nothing, so a rejected request
leaves the engine's state to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from narwhal.fake_engine.faults import RequestFaults


class RequestError(Exception):
    """A request vLLM would reject: becomes an error body with this status."""

    def __init__(
        self, status: int, message: str, *, err_type: str | None = None, param: str | None = None,
        validation: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        # Refused by the request's validation, before any handler runs: vLLM's refusal cleanup
        # (``_with_kv_transfer_rejection_cleanup``) never sees it, so no handoff is freed.
        self.validation = validation


def validation_error(field: str, kind: str, msg: str, value: Any) -> RequestError:
    """FastAPI's request-validation 400 as vLLM shapes it (``serve/exception_handling/handlers/
    validation.py``: ``type`` ``"Bad Request"``, ``param`` ``body.<field>``), seen on a real
    0.32 engine for a mistyped ``stop`` and Messages ``max_tokens: 0``."""
    detail = f"{{'type': '{kind}', 'loc': 'body.{field}', 'msg': '{msg}', 'input': '{value}'}}"
    return RequestError(400, f"1 validation error:\n  {detail}", err_type="Bad Request", param=f"body.{field}",
                        validation=True)


def model_check_error(message: str, parameter: str) -> RequestError:
    """A ``VLLMValidationError`` raised by a request model's validator, as vLLM's error handler
    shapes it (``BadRequestError``, ``(parameter=…)``): also before any handler (seen on a real
    0.32 engine: ``stream_options`` without a stream leaves the handoff pinned)."""
    return RequestError(400, f"{message} (parameter={parameter})", err_type="BadRequestError", param=parameter,
                        validation=True)


@dataclass(slots=True)
class ParsedRequest:
    """What generation needs of a validated request; trusted as is (module invariant)."""

    chat: bool
    phase: str
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt_tokens: int
    kv_params: dict[str, Any] | None
    faults: RequestFaults | None
    kind: str = ""  # "completions", "chat", "messages", "responses" or "generate"
    request_id: str | None = None  # the body's request_id (responses, generate)
    continuous_usage: bool = False  # stream_options asks for usage on every chunk too
    start: int = 0  # the first token's index: past the output a continuation carries (fake_engine.continuation)


def detect_phase(body: dict[str, Any]) -> str:
    """Prefill, or decode, as vLLM would treat the body; picks the fault spec and labels the record."""
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict):
        if kv.get("do_remote_decode") is True:
            return "prefill"
        if kv.get("do_remote_prefill") is True:
            return "decode"
        return "decode"
    if (
        kv is None
        and not body.get("stream")
        and body.get("max_tokens", body.get("max_completion_tokens")) == 1
        and body.get("ignore_eos") is True
    ):
        return "prefill"
    return "decode"


def _words(text: Any) -> int:
    return len(text.split()) if isinstance(text, str) else 0


def count_prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """Whitespace words stand in for tokens; token-id lists count their length. Minimum 1."""
    total = 0
    if chat:
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                total += _words(content)
            elif isinstance(content, list):
                # Multi-part content: only text parts carry words.
                total += sum(_words(p.get("text")) for p in content if isinstance(p, dict))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            total = _words(prompt)
        elif isinstance(prompt, list):
            for item in prompt:
                if isinstance(item, str):
                    total += _words(item)
                elif isinstance(item, int):
                    total += 1
                elif isinstance(item, list):
                    total += len(item)
    return max(total, 1)


def int_field(body: dict[str, Any], key: str) -> int | None:
    """``body[key]`` as a non-negative int (None if absent); 400 otherwise, bools included."""
    value = body.get(key)
    if value is None:
        return None
    # pydantic's lax mode, as vLLM's request models validate: "2" and 2.0 are 2 (a real 0.32
    # engine took ``"max_tokens": "2"``); anything else is FastAPI's validation 400.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise validation_error(key, "int_type", "Input should be a valid integer", value)
    if value < 0:
        raise RequestError(400, f"`{key}` must be a non-negative integer, got {value!r}.")
    return value


def parse_faults(body: dict[str, Any]) -> RequestFaults | None:
    """The request's own faults (``narwhal_fake``), None if it has none; 400 if they do not validate."""
    raw_faults = body.get("narwhal_fake")
    if raw_faults is None:
        return None
    try:
        return RequestFaults.model_validate(raw_faults)
    except ValidationError as exc:
        raise RequestError(400, f"invalid narwhal_fake: {exc}") from None


def resolve_model(body: dict[str, Any], models: list[str]) -> str:
    """The model asked for, or the engine's first; 404 for one it does not serve, as vLLM."""
    model = body.get("model")
    if model is None:
        return models[0]
    if model not in models:
        raise RequestError(404, f"The model `{model}` does not exist.", err_type="NotFoundError", param="model")
    return str(model)


def check_context(max_tokens: int | None, prompt_tokens: int, max_model_len: int, current: bool = True,
                  generate: bool = False) -> int | None:
    """vLLM's serving layer on length, per release; the ``max_tokens`` the engine then runs with.

    0.12 on (``serve/utils/api_utils.py``, ``renderers/params.py``; the same on a real 0.32
    engine): only ``max_tokens > max_model_len`` is refused, with its own message; a prompt
    that alone fills the context is refused; otherwise ``max_tokens`` is clamped to what the
    context has left. ``/inference/v1/generate`` never refuses on length. 0.11 refuses a prompt
    plus ``max_tokens`` beyond the context. Each refusal is raised inside the handler, so a
    release that frees refused handoffs frees this one."""
    if generate:
        return max_tokens
    if not current:
        if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
            raise RequestError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                               f"model's maximum context length is {max_model_len} tokens and your request has "
                               f"{prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens}).")
        return max_tokens
    if max_tokens is not None and max_tokens > max_model_len:
        raise RequestError(400, f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                           f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                           param="max_tokens")
    if prompt_tokens >= max_model_len:
        raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                           f"request has {prompt_tokens} input tokens. Please reduce the length of the input.")
    if max_tokens is not None:
        return min(max_tokens, max_model_len - prompt_tokens)
    return max_tokens


def _check_stop(stop: Any) -> None:
    """``stop``: ``str | list[str] | None``; anything else is FastAPI's validation 400, one error
    per member of the union (as a real 0.32 engine answered ``"stop": 5``)."""
    if stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return
    errors = [f"{{'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', "
              f"'input': '{stop}'}}"]
    if not isinstance(stop, list):
        errors.append(f"{{'type': 'list_type', 'loc': 'body.stop', 'msg': 'Input should be a valid list', "
                      f"'input': '{stop}'}}")
    label = "error" if len(errors) == 1 else "errors"
    raise RequestError(400, f"{len(errors)} validation {label}:\n  " + "\n  ".join(errors), err_type="Bad Request",
                       param="body.stop", validation=True)


def parse_request(body: Any, chat: bool, models: list[str], max_model_len: int = 8192,
                  current: bool = True) -> ParsedRequest:
    """Validate like vLLM; raise ``RequestError`` with the status vLLM would answer."""
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    phase = detect_phase(body)
    faults = parse_faults(body)
    model = resolve_model(body, models)

    if chat:
        if not isinstance(body.get("messages"), list):
            raise RequestError(400, "`messages` must be a list of chat messages.")
        if body.get("continue_final_message") and body.get("add_generation_prompt"):  # vLLM's validator
            raise model_check_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                    "continue_final_message")
    elif "prompt" not in body or body["prompt"] is None:
        raise RequestError(400, "`prompt` is required.")

    stream = body.get("stream") is True
    stream_options = body.get("stream_options")
    if stream_options and not stream:  # vLLM's validator: truthy options, falsy stream
        raise model_check_error("Stream options can only be defined when `stream=True`.", "stream_options")

    _check_stop(body.get("stop"))
    max_tokens = int_field(body, "max_tokens")
    if chat:
        # vLLM's chat API prefers the newer key when both are given.
        max_completion = int_field(body, "max_completion_tokens")
        if max_completion is not None:
            max_tokens = max_completion
    min_tokens = int_field(body, "min_tokens")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise RequestError(
            400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )

    prompt_tokens = count_prompt_tokens(body, chat)
    max_tokens = check_context(max_tokens, prompt_tokens, max_model_len, current)
    kv = body.get("kv_transfer_params")
    options = stream_options if isinstance(stream_options, dict) else {}
    include_usage = options.get("include_usage") is True  # vLLM's should_include_usage
    return ParsedRequest(
        chat=chat,
        phase=phase,
        model=model,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and options.get("continuous_usage_stats") is True,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        kv_params=kv if isinstance(kv, dict) else None,
        faults=faults,
        kind="chat" if chat else "completions",
    )
