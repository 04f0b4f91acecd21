"""One description per P/D endpoint of what its stream and bodies look like (SPEC §2.1).

``for_endpoint(path)`` gives the :class:`Dialect` of a route; the request path (admission, the
legs, the relay, the router's errors) asks it whatever differs between endpoints, so there is one
path for all of them. Unknown paths get the completions description (the engine client's
callers outside the router, probes and preflight, speak completions or chat).
"""

from __future__ import annotations

from narwhal.engines.dialects.base import Dialect
from narwhal.engines.dialects.messages import MESSAGES, Messages
from narwhal.engines.dialects.openai import CHAT, COMPLETIONS, GENERATE, Chat, Completions, Generate
from narwhal.engines.dialects.responses import RESPONSES, Responses

BY_ENDPOINT: dict[str, Dialect] = {
    d.endpoint: d for d in (Completions(), Chat(), Generate(), Messages(), Responses())
}
_DEFAULT = BY_ENDPOINT[COMPLETIONS]


def for_endpoint(endpoint: str) -> Dialect:
    return BY_ENDPOINT.get(endpoint, _DEFAULT)


__all__ = ["BY_ENDPOINT", "CHAT", "COMPLETIONS", "GENERATE", "MESSAGES", "RESPONSES", "Dialect", "for_endpoint"]
