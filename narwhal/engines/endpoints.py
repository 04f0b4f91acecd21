"""The one registry of the router's client endpoints (docs/behaviour.md "The other P/D endpoints"): every POST route,
once.

An :class:`Endpoint` is a path, whether it takes the P/D path or is passed through to one
engine, and its :class:`~narwhal.engines.dialects.Dialect` — the endpoint's admission checks,
affinity text, usage fields, engine bodies, stream rules, error shape and probe body. Routes
(``narwhal.worker.app``), admission, affinity, the legs, the supervisor's probes and preflight
all read this table; none keeps a list or a path of its own. A new endpoint is one line here
(and a dialect for a P/D one).

Why the request carries it: the route resolves its endpoint once, when the app is built, and
every step after that (admission, affinity, prefill, decode, the router's errors) reads the
object it was handed — no per-request lookup by path (there were five per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal.engines.dialects import Dialect
from narwhal.engines.dialects.messages import Messages
from narwhal.engines.dialects.openai import Chat, Completions, Generate
from narwhal.engines.dialects.responses import Responses


@dataclass(frozen=True, slots=True, eq=False)
class Endpoint:
    """One client route. ``dialect``: for a P/D endpoint everything that differs between
    endpoints; for a passthrough one only OpenAI's error shape (its body is the engine's)."""

    path: str
    dialect: Dialect
    passthrough: bool = False
    x_api_key: bool = False  # the key may also come in x-api-key (the Anthropic SDK's header)

    def __repr__(self) -> str:
        return f"Endpoint({self.path!r})"


_OPENAI_SHAPE = Dialect()  # the base description: OpenAI's error body, nothing else used



def _pd(dialect: Dialect, *, x_api_key: bool = False) -> Endpoint:
    return Endpoint(dialect.endpoint, dialect, x_api_key=x_api_key)  # the path its dialect describes


COMPLETIONS = _pd(Completions())
CHAT = _pd(Chat())
RESPONSES = _pd(Responses())
MESSAGES = _pd(Messages(), x_api_key=True)
GENERATE = _pd(Generate())

ENDPOINTS: tuple[Endpoint, ...] = (
    COMPLETIONS, CHAT, RESPONSES, MESSAGES, GENERATE,
    # One request to one engine, its answer relayed (``narwhal.request.passthrough``).
    *(Endpoint(path, _OPENAI_SHAPE, passthrough=True) for path in (
        "/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
    )),
)
BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS}
PD_ENDPOINTS: tuple[Endpoint, ...] = tuple(e for e in ENDPOINTS if not e.passthrough)
PASSTHROUGH: tuple[Endpoint, ...] = tuple(e for e in ENDPOINTS if e.passthrough)

# What the supervisor's probes and preflight speak: the one endpoint every vLLM serves.
PROBE = COMPLETIONS


def probe_body(model: str, prompt: str) -> dict[str, Any]:
    """A two-token :data:`PROBE` request for ``model``."""
    return PROBE.dialect.probe_body(model, prompt)


def of(path: str) -> Endpoint:
    """The registered endpoint at ``path``; completions for any other (callers outside the
    router, such as tools, that name a path)."""
    return BY_PATH.get(path, COMPLETIONS)
