"""Admission, the one door of every route (docs/behaviour.md "Admission"): read the body once,
check what the router reads, refuse the rest with a 4xx, and hand the router a request ready to
place (:meth:`Admission.admit`).

The body is parsed once with orjson and kept as a dict; every engine body is built from that
dict (never spliced from the client's bytes), so a duplicate key cannot smuggle a client
value through. Client ``kv_transfer_params`` are dropped here, always. Fields the router
does not read are passed to the engines untouched: vLLM, not the router, owns sampling
validation.

Types are tested exactly (``type(v) is str``, membership before subscript): orjson's values
are never subclasses, so the answer is isinstance's, and the checks cost no call per field.
The prompt's fields are then
encoded once and embedded in every engine body (:func:`embed_prompt`), so a long prompt costs
one parse and one encode, not one encode per leg.

Headers are admitted here too, and nothing a client puts in one can fail the request: a
credential is compared as the bytes the client sent (a 401 at worst), and the only headers
passed on to engines, W3C trace context, are passed only when valid (``trace_context``).
"""

from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from narwhal.engines.endpoints import GENERATE, Endpoint
from narwhal.errors import RequestError
from narwhal.fleet import Fleet
from narwhal.fleet.endpoint_support import NONE, PD, EndpointSupport
from narwhal.fleet.placement.policy import Policy
from narwhal.reasons import Reason
from narwhal.request.affinity import prepared
from narwhal.request.ids import printable_ascii
from narwhal.settings import Settings

DEADLINE_HEADER = "x-narwhal-deadline-s"
# W3C Trace Context's lengths: a version-00 traceparent is 55 characters; a tracestate has at
# most 32 list members, each a key and a value of at most 256 characters.
_TRACEPARENT_MAX = 55
_TRACESTATE_MEMBERS = 32
_TRACESTATE_MEMBER_MAX = 256 + 1 + 256


@dataclass(slots=True)
class ClientRequest:
    """A request past admission: what every attempt needs, checked once; the placement hints come after."""

    endpoint: Endpoint  # resolved by the route: nothing looks it up again
    body: dict[str, Any]
    model: str
    stream: bool
    deadline: float  # loop.time() units
    forward: dict[str, str]
    local: bool = False  # a prompt short enough to skip the remote prefill (docs/behaviour.md "Placement")
    note: Any = None  # the placement policy's, carried unread (narwhal.request.affinity)
    # The prompt fields' values once ``body`` holds them encoded (``embed_prompt``): what a
    # stream's continuation is built from (narwhal.request.migration).
    prompt: dict[str, Any] = field(default_factory=dict)


def presented_token(request: web.Request, *, x_api_key: bool = False) -> bytes:
    """The ``Authorization: Bearer`` token (or, with ``x_api_key``, ``x-api-key``'s value) as the
    bytes the client sent. aiohttp decoded them as UTF-8 with surrogate escapes, so encoding
    back the same way cannot fail, whatever the bytes: a token that is not UTF-8 is a wrong one."""
    given = request.headers.get("Authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if not token and x_api_key:
        token = request.headers.get("x-api-key", "")
    return token.encode("utf-8", "surrogateescape")


def check_api_key(request: web.Request, keys: list[str], *, x_api_key: bool = False) -> None:
    """``x_api_key``: also accept the key in ``x-api-key`` (the Anthropic SDK's header, on
    ``/v1/messages``). Neither header is ever forwarded to an engine."""
    if not keys:
        return
    token = presented_token(request, x_api_key=x_api_key)
    # Compare against every key so the time taken does not reveal which one nearly matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key.encode())
    if not ok:
        raise RequestError("invalid or missing API key", reason=Reason.UNAUTHORIZED)


def _valid_tracestate(value: str) -> bool:
    members = [m for m in value.split(",") if m.strip(" ")]  # empty list members are allowed
    return len(members) <= _TRACESTATE_MEMBERS and all(len(m.strip(" ")) <= _TRACESTATE_MEMBER_MAX for m in members)


def trace_context(request: web.Request, parent: str | None) -> dict[str, str]:
    """The client's ``traceparent`` / ``tracestate`` to send on both legs, each only when it is
    valid W3C trace context: printable ASCII within W3C's lengths (docs/behaviour.md "The request
    path"). An invalid one is dropped, not refused: tracing is the client's convenience, never a
    reason to fail its request, and an engine must never see bytes the router cannot vouch for.
    ``parent``: the ``traceparent`` header as the router read it for the access log (None: not
    sent), read once."""
    forward = {}
    if parent and len(parent) <= _TRACEPARENT_MAX and printable_ascii(parent):
        forward["traceparent"] = parent
    state = request.headers.get("tracestate")
    if state and printable_ascii(state) and _valid_tracestate(state):
        forward["tracestate"] = state
    return forward


async def read_body(request: web.Request, settings: Settings) -> bytes:
    """The raw body, read once: JSON, at most ``max_body_bytes``, within ``body_read_timeout_s``; else a 4xx."""
    ctype = request.headers.get("Content-Type")
    if ctype is not None and ctype != "application/json":  # what nearly every client sends, as is
        mime = ctype.split(";", 1)[0].strip().lower()
        if mime != "application/json" and not mime.endswith("+json"):
            raise RequestError(
                f"unsupported content type {mime!r}: send application/json", reason=Reason.UNSUPPORTED_MEDIA_TYPE
            )
    limit = settings.server.max_body_bytes
    try:
        content = request.content
        if content.is_eof():
            # The whole body is here: nothing to wait for, no timer, and taken in one piece
            # (``read()`` would loop over it in chunks); its size says what Content-Length would.
            raw = content.read_nowait()
            if len(raw) > limit:
                raise RequestError(f"request body exceeds {limit} bytes", reason=Reason.PAYLOAD_TOO_LARGE)
            return raw
        length = request.content_length  # refused before waiting for a body that is too long
        if length is not None and length > limit:
            raise RequestError(f"request body exceeds {limit} bytes", reason=Reason.PAYLOAD_TOO_LARGE)
        async with asyncio.timeout(settings.server.body_read_timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestError(
            f"request body not received within {settings.server.body_read_timeout_s:g}s",
            reason=Reason.REQUEST_TIMEOUT,
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(f"request body exceeds {limit} bytes", reason=Reason.PAYLOAD_TOO_LARGE) from None
    except (web.RequestPayloadError, HttpProcessingError):
        # A body that does not decode as its Content-Encoding says, or a broken chunked body.
        raise RequestError("the request body could not be read (bad encoding or framing)") from None


def _bad(message: str, param: str | None = None) -> RequestError:
    error = RequestError(message, reason=Reason.BAD_REQUEST)
    error.param = param
    return error


def _check_stripped(body: dict[str, Any], prefix: str = "") -> None:
    """The fields the prefill drops (``connector.prefill_body``), checked as vLLM's request
    validation checks them. The producer never sees them, so only the consumer would refuse them,
    after the prefill, with a validation 400 that frees nothing: the handoff would stay pinned.
    Refused here, before any prefill (docs/behaviour.md, "A consumer's refusal"). ``prefix``:
    where they sit (generate's ``sampling_params.``)."""
    if "stop" in body and (stop := body["stop"]) is not None and type(stop) is not str and not (
            type(stop) is list and all(type(s) is str for s in stop)):
        raise _bad(f"'{prefix}stop' must be a string or a list of strings", f"{prefix}stop")
    if "stop_token_ids" in body and (ids := body["stop_token_ids"]) is not None and not (
            type(ids) is list and all(type(i) is int for i in ids)):
        raise _bad(f"'{prefix}stop_token_ids' must be a list of integers", f"{prefix}stop_token_ids")
    if "min_tokens" in body and (least := body["min_tokens"]) is not None:
        if type(least) is not int or least < 0:
            raise _bad(f"'{prefix}min_tokens' must be an integer >= 0", f"{prefix}min_tokens")
        most = body.get("max_tokens")
        if type(most) is int and least > most:  # vLLM's SamplingParams refuses it, on the consumer only
            raise _bad(f"min_tokens must be less than or equal to max_tokens={most}, got {least}.",
                       f"{prefix}min_tokens")


def _check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    # Membership tests and exact types (``type(v) is str``): the body came from orjson, whose
    # values are never subclasses, so these say what isinstance would, without a call per field.
    if "model" in body and (model := body["model"]) is not None and type(model) is not str:
        raise _bad("'model' must be a string")
    if "stream" in body and (stream := body["stream"]) is not None and type(stream) is not bool:
        raise _bad("'stream' must be a boolean")
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and (value := body[key]) is not None and (type(value) is not int or value < 0):
            raise _bad(f"'{key}' must be an integer >= 0")
    if "stream_options" in body and (options := body["stream_options"]) is not None:
        if type(options) is not dict:
            raise _bad("'stream_options' must be an object", "stream_options")
        if options and body.get("stream") is not True:  # vLLM's own test: truthy options, falsy stream
            raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    _check_stripped(body)
    endpoint.dialect.check(body)  # the endpoint's own fields: prompt, messages, token_ids …
    if endpoint is GENERATE:  # its sampling fields sit in sampling_params (an object: checked above)
        _check_stripped(body["sampling_params"], "sampling_params.")
    # Disaggregation runs one prefill and one decode: what needs more cannot be honoured.
    for key in ("n", "best_of"):
        if key in body and (value := body[key]) is not None and (type(value) is not int or value > 1):
            raise _bad(f"'{key}' > 1 is not supported by disaggregated serving")
    if "prompt_logprobs" in body and (value := body["prompt_logprobs"]) is not None and value is not False \
            and value != 0:
        raise _bad("'prompt_logprobs' is not supported by disaggregated serving")


# A prompt string shorter than this is cheaper to encode again per leg than to embed.
_EMBED_MIN_CHARS = 512


def embed_prompt(body: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Replace the prompt's fields in ``body`` by their JSON, encoded once (``orjson.Fragment``).

    Why: the prefill and the decode bodies (and a release's) are each encoded from the parsed
    body; without this the prompt — the part that grows with its length — was encoded again for
    every leg. A fragment is copied into each body as it is, so a long prompt costs one parse
    and one encode whatever the legs. Run after everything that reads the prompt (admission's
    checks, the affinity text): from here the fields hold encoded JSON, not values. Returns the
    fields' values, for whatever must still read them (a continuation).
    """
    values = {}
    for key in fields:
        value = values[key] = body.get(key)
        if type(value) is list or (type(value) is str and len(value) >= _EMBED_MIN_CHARS):
            body[key] = orjson.Fragment(orjson.dumps(value))
    return values


def request_deadline(request: web.Request, settings: Settings, arrival: float) -> float:
    """When the request must end (loop time): ``deadline_s`` after arrival; the client's header only shortens it."""
    budget = settings.request.deadline_s
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is not None:
        try:
            asked = float(raw)
        except ValueError:
            asked = math.nan
        if not math.isfinite(asked) or asked <= 0:
            raise _bad(f"'{DEADLINE_HEADER}' must be a positive number of seconds")
        budget = min(budget, asked)
    return arrival + budget


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, client ``kv_transfer_params`` removed (every route's first step)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"invalid JSON body: {exc}") from None
    if type(body) is not dict:  # orjson's objects are exactly dict
        raise _bad("the request body must be a JSON object")
    body.pop("kv_transfer_params", None)
    if "sampling_params" in body:
        _drop_nested_handoff(body)
    if "vllm_xargs" in body:
        _drop_xargs_handoff(body)
    return body


def _drop_xargs_handoff(body: dict[str, Any]) -> None:
    """``vllm_xargs.kv_transfer_params``: vLLM builds the sampling ``extra_args`` from
    ``vllm_xargs`` and keeps that key when the body has no top-level one (a same-worker or local
    decode, a passthrough), so a client's would reach the engine (a real 0.32 producer answers
    500 to ``"x"``: a healthy engine charged a failure per request). Removed on every route."""
    xargs = body["vllm_xargs"]
    if type(xargs) is dict and "kv_transfer_params" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}


def _drop_nested_handoff(body: dict[str, Any]) -> None:
    """``sampling_params.extra_args.kv_transfer_params``: where vLLM's generate route reads a
    handoff when the top-level key is absent (``scale_out/token_in_token_out/serving.py``), as on
    a same-worker or local decode. A client's would make the engine read KV from whatever host it
    names: removed, like the top-level one (and ``vllm_xargs``' own: :func:`_drop_xargs_handoff`)."""
    params = body["sampling_params"]
    extra = params.get("extra_args") if type(params) is dict else None
    if type(extra) is dict and "kv_transfer_params" in extra:
        extra = {k: v for k, v in extra.items() if k != "kv_transfer_params"}
        body["sampling_params"] = {**params, "extra_args": extra}


def resolve_model(body: dict[str, Any], fleet: Fleet) -> str:
    """The model the body is for: its ``model``, or the fleet's only one when it names none."""
    model = body.get("model")
    if model is None:
        # vLLM serves its one model when none is named; do the same when the fleet has one.
        served = fleet.served_models
        if len(served) != 1:
            raise _bad("'model' is required")
        model = next(iter(served))
    elif type(model) is not str:  # exact, as _check_fields: orjson's strings are never subclasses
        raise _bad("'model' must be a string")
    if not fleet.serves(model):
        raise RequestError(f"The model `{model}` does not exist.", reason=Reason.MODEL_NOT_FOUND)
    return model


def parse(raw: bytes, endpoint: Endpoint, fleet: Fleet) -> tuple[dict[str, Any], str, bool]:
    """Parse and check the body; return it (client kv params removed), its model and stream."""
    body = parse_object(raw)
    _check_fields(body, endpoint)
    model = resolve_model(body, fleet)
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
        if limit is None:
            limit = body.get("max_output_tokens")
    if type(limit) is int and endpoint is not GENERATE:  # vLLM's generate never refuses on length
        _check_limit(limit, fleet.context(model))
    return body, model, bool(body.get("stream"))


def _check_limit(limit: int, context: int | None) -> None:
    """A limit above the model's context (the smallest ``max_model_len`` its engines report) is
    refused here with vLLM's own message and ``param`` (0.12 on): the prefill asks for one token
    and cannot see it, so the consumer would refuse it only after a handoff exists
    (docs/decisions.md "vLLM releases")."""
    if context is not None and limit > context:
        raise _bad(f"max_tokens={limit} cannot be greater than max_model_len={context}. Please request fewer "
                   f"output tokens. (parameter=max_tokens, value={limit})", "max_tokens")


def parse_passthrough(raw: bytes, fleet: Fleet) -> tuple[dict[str, Any], str]:
    """A passthrough route's body (client ``kv_transfer_params`` removed) and the model it is for:
    only ``model`` is the router's business, every other field is the engine's to validate."""
    body = parse_object(raw)
    return body, resolve_model(body, fleet)


async def checked_request(
    request: web.Request, endpoint: Endpoint, settings: Settings, fleet: Fleet, arrival: float,
    traceparent: str | None,
) -> ClientRequest:
    """Key, deadline and body checked once, before anything is placed; a ``RequestError`` (4xx) if not.
    ``traceparent``: the header as the router read it (:func:`trace_context`). A passthrough
    route's body is only an object naming a model (every other field is its engine's to
    validate), and its answer is relayed whole."""
    check_api_key(request, settings.server.api_keys, x_api_key=endpoint.x_api_key)
    deadline = request_deadline(request, settings, arrival)
    raw = await read_body(request, settings)
    if endpoint.passthrough:
        (body, model), stream = parse_passthrough(raw, fleet), False
    else:
        body, model, stream = parse(raw, endpoint, fleet)
    return ClientRequest(
        endpoint=endpoint, body=body, model=model, stream=stream, deadline=deadline,
        forward=trace_context(request, traceparent),
    )


class TokenIds(Protocol):
    """The prompt's token ids for the policy's note (``narwhal.request.prompt_tokens.PromptTokens``)."""

    def wanted(self, req: ClientRequest) -> bool:
        """Does the policy want this request's token ids?"""

    def give(self, req: ClientRequest, request_id: str) -> Awaitable[None]:
        """Hand the request's note its prompt's token ids."""


class Admission:
    """One worker's door: every route's request is admitted here once, and leaves ready to place."""

    def __init__(self, settings: Settings, fleet: Fleet, policy: Policy, token_ids: TokenIds) -> None:
        self.settings = settings
        self.fleet = fleet
        self.policy = policy
        self.token_ids = token_ids
        self._support = EndpointSupport(fleet)  # which endpoints the engines' releases serve, how

    async def admit(
        self, request: web.Request, endpoint: Endpoint, arrival: float, traceparent: str | None, request_id: str,
    ) -> ClientRequest:
        """The request checked (:func:`checked_request`) and, on a P/D route, ready to place: a
        local decode decided and the placement policy's note kept (``narwhal.request.affinity``),
        the engines' releases asked whether they hand off here, the prompt's token ids given to
        the note where the policy wants them, and the prompt's fields encoded once
        (:func:`embed_prompt`). A 4xx (``RequestError``) if not; ``request_id`` is the client's."""
        req = await checked_request(request, endpoint, self.settings, self.fleet, arrival, traceparent)
        if endpoint.passthrough:
            return req
        req.local, req.note = prepared(endpoint, req.body, self.settings.placement, self.policy)
        support = self._support.of(req.model, endpoint.path)
        if support is not PD:  # the engines' release cannot hand off here (0.11 and Responses, …)
            req.local = _served_alone(support, req.model, endpoint.path)
        if self.token_ids.wanted(req):  # a producer's KV-cache events are followed
            await self.token_ids.give(req, request_id + "-tokenize")
        # Nothing reads the prompt from the body after this; a continuation reads req.prompt.
        req.prompt = embed_prompt(req.body, endpoint.dialect.prompt_fields)
        return req


def _served_alone(support: str, model: str, path: str) -> bool:
    """A request the engines' releases cannot hand off on: one engine serves it (True), or 501."""
    if support is NONE:
        raise RequestError(f"{path} is not served by the vLLM release of the engines serving {model!r}",
                           reason=Reason.NOT_IMPLEMENTED)
    return True
