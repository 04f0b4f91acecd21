"""Fault specifications for the fake vLLM engine (docs/behaviour.md "Fake engines").

Why pydantic with ``extra="forbid"``: fault specs arrive from tests over HTTP (per request inside
the body's ``narwhal_fake`` key, or engine-wide through the control server). A typo such as
``delay_first_tokens_s`` must fail loudly with a 400 instead of silently injecting nothing and
letting a test pass for the wrong reason.

Two sources, one effective spec: the engine-wide spec for a phase is the baseline and a
per-request spec overrides it *field by field* — only the fields the request actually set
(``model_fields_set``) win, so ``{"token_delay_s": 0.1}`` in a request keeps an engine-wide
``silence_after``. ``only_engine`` is checked on each source separately before merging, so a
per-request spec aimed at another engine does not disturb this engine's own faults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# "empty_groups" and "hybrid_groups" are not faults but valid 0.33 shapes a test asks for: block ids
# ``[[]]`` (one KV cache group, nothing to read) and ``[[], [...]]`` (a hybrid model's group with none).
DescriptorFault = Literal[
    "null", "missing", "no_engine_id", "bad_blocks", "mooncake", "lmcache", "bad_port", "localhost",
    "empty_groups", "hybrid_groups",
]


class StreamError(BaseModel):
    """An error object sent inside an HTTP 200 stream, followed by ``[DONE]`` (vLLM's habit)."""

    model_config = ConfigDict(extra="forbid")

    # None means the error object carries ``"code": null`` (routers must fall back to 502).
    code: int | None = 500
    message: str = "Internal server error"
    after: int = Field(default=0, ge=0)
    flat: bool = False


class FaultSpec(BaseModel):
    """What one phase (prefill or decode) of a request should suffer. All fields optional."""

    model_config = ConfigDict(extra="forbid")

    status: int | None = Field(default=None, ge=100, le=599)
    message: str | None = None
    flat_error: bool = False
    # With ``status`` 400: refused by the request's validation, before any handler (vLLM's
    # "Bad Request" shape, ``parse.validation_error``): no release frees the handoff then.
    validation: bool = False
    reset: bool = False
    delay_headers_s: float = Field(default=0.0, ge=0)
    delay_first_token_s: float = Field(default=0.0, ge=0)
    tokens: int | None = Field(default=None, ge=0)
    token_delay_s: float | None = Field(default=None, ge=0)
    silence_after: int | None = Field(default=None, ge=0)
    silence_s: float = Field(default=0.0, ge=0)
    heartbeat_s: float | None = Field(default=None, gt=0)
    close_after: int | None = Field(default=None, ge=0)
    done_before_token: bool = False
    stream_error: StreamError | None = None
    # /v1/responses without streaming: a 200 whose Response has "status": "failed" and this
    # error (its code and message; ``after`` and ``flat`` do not apply), no descriptor.
    failed: StreamError | None = None
    descriptor: DescriptorFault | None = None
    empty: bool = False
    only_engine: str | None = None
    # Only streamed requests suffer it: a release (one token, not streamed) goes through.
    streams_only: bool = False
    # Not a fault: a reasoning model's thinking. The first N tokens of a chat stream are
    # reasoning deltas, in the release's shape (``delta.reasoning``; 0.11 ``reasoning_content``).
    reasoning: int = Field(default=0, ge=0)


class RequestFaults(BaseModel):
    """The body's ``narwhal_fake`` object."""

    model_config = ConfigDict(extra="forbid")

    prefill: FaultSpec | None = None
    decode: FaultSpec | None = None
    # The passthrough routes (/tokenize, /v1/embeddings, ...): status, message, flat_error,
    # reset and delay_headers_s apply there.
    passthrough: FaultSpec | None = None


class EngineFaults(BaseModel):
    """Engine-wide faults, replaced as a whole by ``PUT /engines/{name}/faults``."""

    model_config = ConfigDict(extra="forbid")

    prefill: FaultSpec | None = None
    decode: FaultSpec | None = None
    passthrough: FaultSpec | None = None  # as in RequestFaults
    # Status of GET /health (vLLM answers 503 with an empty body on EngineDeadError).
    health_status: int | None = Field(default=None, ge=100, le=599)
    # Reads of this engine's held KV blocks fail: consumers pulling from it fail the decode.
    kv_read_fails: bool = False
    version: str | None = None
    models: list[str] | None = None
    # GET /metrics hangs (no answer until the client gives up) or answers 200 with text that
    # is not Prometheus exposition: what a router's load reader must survive.
    metrics: Literal["hang", "garbage"] | None = None

    def for_phase(self, phase: str) -> FaultSpec | None:
        """The engine-wide fault spec of ``phase`` (prefill, decode or passthrough)."""
        if phase == "passthrough":
            return self.passthrough
        return self.prefill if phase == "prefill" else self.decode


NO_FAULTS = EngineFaults()


def _applies(spec: FaultSpec | None, engine_name: str) -> bool:
    return spec is not None and (spec.only_engine is None or spec.only_engine == engine_name)


def effective_spec(
    engine_spec: FaultSpec | None, request_spec: FaultSpec | None, engine_name: str
) -> FaultSpec | None:
    """Merge the engine-wide and per-request specs of one phase; None means "no fault at all"."""
    base = engine_spec if _applies(engine_spec, engine_name) else None
    override = request_spec if _applies(request_spec, engine_name) else None
    if override is None:
        return base
    if base is None:
        return override
    update = {name: getattr(override, name) for name in override.model_fields_set}
    return base.model_copy(update=update)
