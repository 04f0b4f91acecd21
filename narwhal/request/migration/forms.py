"""How each endpoint asks vLLM to continue an output: the continuation's endpoint and body.

- chat: the messages, then an assistant message holding the text so far, with
  ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM renders the chat
  template up to that message's end, without closing it). A client that already asked to
  continue its own final assistant message gets the text added to that message instead.
- completions: the prompt and the text so far; a prompt of token ids and the ids so far, when
  the client asked for them (``return_token_ids``).
- generate: ``token_ids`` and the ids so far — by tokens, so nothing is tokenized again.
- messages: vLLM's ``/v1/messages`` does not continue a final assistant message (it converts to
  a chat request with the generation prompt on, and no ``continue_final_message``), so the
  continuation goes through the chat form: the Anthropic request as vLLM itself would convert
  it (system, text turns, sampling), on ``/v1/chat/completions``, with usage asked for so the
  stream's end can say it (``splice``). Tools, thinking, and non-text blocks are not converted:
  such a stream is not continued.
- responses: not continued (docs/decisions.md "Migration": its events number themselves and
  name the items they build; a faithful continuation would rewrite all of it).

Never continued, whatever the cut (``never_continued``): constrained output of any form
(``response_format`` ``json_object``/``json_schema``/``structural_tag``, ``structured_outputs``,
``guided_*``), a ``tool_choice`` other than ``"none"``/``"auto"``, and ``n``/``best_of`` above 1.
vLLM starts a grammar at its root for every request, so a continuation would write a second
document after the first half of one; a forced tool call would be forced again.

A continuation leg asks only for the continuation: never ``echo`` (vLLM's chat stream resends a
final assistant message first, which in a continuation is the output so far) nor
``prompt_logprobs`` (the continuation's prompt is not the client's).

The limit becomes what is left (``max_tokens``, ``max_completion_tokens``, generate's
``sampling_params.max_tokens``; completions' unset limit is vLLM's default of 16), and
``min_tokens`` what is left of it; ``stop`` and the sampling parameters are kept. A ``seed``
cannot make the continuation what the unbroken stream would have been: the sampler's state is
not carried over.

Invariant: pure — a function of the original body, its prompt values and what the client saw;
None (with why) when no faithful continuation exists.
"""

from __future__ import annotations

from typing import Any

from narwhal.engines.endpoints import CHAT, COMPLETIONS, GENERATE, MESSAGES, Endpoint
from narwhal.request.migration.seen import Seen

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens default
KINDS: dict[Endpoint, str] = {CHAT: "chat", COMPLETIONS: "completions", GENERATE: "generate", MESSAGES: "messages"}
"""The endpoints whose streams may continue, and the kind of output each reads (``seen``)."""

_ANTHROPIC_ONLY = frozenset({
    "system", "messages", "max_tokens", "stop_sequences", "metadata", "tool_choice", "tools", "thinking",
    "stream", "service_tier", "container", "mcp_servers", "output_config", "context_management",
    "kv_transfer_params",
})


_ONLY_FIRST_LEG = ("echo", "prompt_logprobs")  # what a continuation leg never asks for


class NotContinued(Exception):
    """No faithful continuation exists; the message says why."""


def _constrained(params: Any) -> str | None:
    """Why the sampling fields in ``params`` (a body, or generate's ``sampling_params``) constrain
    the output, or None."""
    if not isinstance(params, dict):
        return None
    form = params.get("response_format")
    if isinstance(form, dict) and form.get("type") not in (None, "text"):
        return f"response_format {form.get('type')!r}"
    for key, value in params.items():
        if value is not None and (key == "structured_outputs" or key.startswith("guided_")) and value is not False:
            return str(key)
    return None


def never_continued(body: dict[str, Any]) -> str | None:
    """Why a request's stream may never be continued (module docstring), or None."""
    why = _constrained(body) or _constrained(body.get("sampling_params"))
    if why is not None:
        return f"constrained output ({why})"
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        return "a tool_choice that forces a tool"
    for key in ("n", "best_of"):
        if type(body.get(key)) is int and body[key] > 1:
            return f"{key} > 1"
    return None


def _left(limit: Any, seen: Seen) -> int | None:
    if type(limit) is not int:
        return None
    left = limit - seen.tokens
    if left <= 0:
        raise NotContinued("no tokens left of its limit")
    return left


def _limits(out: dict[str, Any], keys: tuple[str, ...], seen: Seen) -> None:
    """The limit and ``min_tokens`` in ``out`` become what is left of them."""
    for key in keys:
        left = _left(out.get(key), seen)
        if left is not None:
            out[key] = left
    low = out.get("min_tokens")
    if type(low) is int:
        out["min_tokens"] = max(low - seen.tokens, 0)


def chat(body: dict[str, Any], messages: Any, seen: Seen) -> dict[str, Any]:
    """The chat continuation (module docstring)."""
    if not isinstance(messages, list):
        raise NotContinued("its messages could not be read")
    text = seen.output
    last = messages[-1] if messages else None
    if body.get("continue_final_message") is True and isinstance(last, dict) and last.get("role") == "assistant" \
            and isinstance(last.get("content"), str):
        turns = [*messages[:-1], {**last, "content": last["content"] + text}]
    else:
        turns = [*messages, {"role": "assistant", "content": text}]
    out = {k: v for k, v in body.items() if k not in _ONLY_FIRST_LEG}
    out.update(messages=turns, continue_final_message=True, add_generation_prompt=False)
    _limits(out, ("max_tokens", "max_completion_tokens"), seen)
    return out


def completions(body: dict[str, Any], prompt: Any, seen: Seen) -> dict[str, Any]:
    """The completions continuation (module docstring)."""
    if body.get("echo") is True:
        raise NotContinued("echo repeats the prompt in the output")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        continued: Any = prompt + seen.output
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt) and seen.token_ids:
        continued = [*prompt, *seen.token_ids]
    else:
        raise NotContinued("its prompt is a batch, or token ids without the output's ids")
    out = {k: v for k, v in body.items() if k not in _ONLY_FIRST_LEG}
    out["prompt"] = continued
    out.setdefault("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    _limits(out, ("max_tokens",), seen)
    return out


def generate(body: dict[str, Any], token_ids: Any, seen: Seen) -> dict[str, Any]:
    """The generate continuation: by tokens (module docstring)."""
    if not isinstance(token_ids, list) or len(seen.token_ids) != seen.tokens:
        raise NotContinued("its token ids could not be read")
    params = {k: v for k, v in (body.get("sampling_params") or {}).items() if k not in _ONLY_FIRST_LEG}
    _limits(params, ("max_tokens",), seen)
    return {**body, "token_ids": [*token_ids, *seen.token_ids], "sampling_params": params}


def _text_of(content: Any) -> Any:
    """An Anthropic content as chat content: a string as is, text blocks as text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return [{"type": "text", "text": b.get("text", "")} for b in content]
    raise NotContinued("a block other than text in its messages")


def messages(body: dict[str, Any], system: Any, turns: Any, seen: Seen) -> dict[str, Any]:
    """The Messages continuation, in the chat form (module docstring)."""
    if body.get("tools") or body.get("tool_choice"):
        raise NotContinued("tools")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise NotContinued("thinking")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise NotContinued("its messages could not be read")
    if turns[-1].get("role") == "assistant":
        raise NotContinued("its last message is the assistant's")
    chat_turns: list[dict[str, Any]] = []
    if system:
        parts = _text_of(system)
        chat_turns.append({"role": "system", "content": parts})
    chat_turns += [{"role": t.get("role"), "content": _text_of(t.get("content"))} for t in turns]
    chat_turns.append({"role": "assistant", "content": seen.output})
    out = {k: v for k, v in body.items() if k not in _ANTHROPIC_ONLY}
    out.update(messages=chat_turns, stream=True, stream_options={"include_usage": True},
               continue_final_message=True, add_generation_prompt=False, max_tokens=body.get("max_tokens"))
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    _limits(out, ("max_tokens",), seen)
    return out


def continuation(endpoint: Endpoint, body: dict[str, Any], prompt: dict[str, Any], seen: Seen) -> tuple[
        Endpoint, dict[str, Any]]:
    """The endpoint and body that continue ``seen`` (``prompt``: the prompt fields' values,
    which ``body`` may hold encoded); raises :class:`NotContinued`."""
    if seen.why_not is not None:
        raise NotContinued(seen.why_not)
    if not seen.tokens:
        raise NotContinued("no output to continue")
    kind = KINDS.get(endpoint)
    if kind == "chat":
        return endpoint, chat(body, prompt.get("messages"), seen)
    if kind == "completions":
        return endpoint, completions(body, prompt.get("prompt"), seen)
    if kind == "generate":
        return endpoint, generate(body, prompt.get("token_ids"), seen)
    if kind == "messages":
        return CHAT, messages(body, prompt.get("system"), prompt.get("messages"), seen)
    raise NotContinued(f"{endpoint.path} streams are not continued")
