"""One description per P/D endpoint of what its stream and bodies look like (docs/behaviour.md "The other P/D
endpoints").

Each :class:`Dialect` answers whatever differs between endpoints (admission, the legs, the
relay, the router's errors), so there is one request path for all of them. Which path has
which dialect is the endpoint registry's (``narwhal.engines.endpoints``), read once per route.
Its modules:

- ``base.py``: ``Dialect``, what every endpoint answers, and the shared rules
- ``openai.py``: completions, chat completions and vLLM's generate
- ``responses.py``: OpenAI's Responses
- ``messages.py``: Anthropic's Messages
"""

from __future__ import annotations

from narwhal.engines.dialects.base import Dialect
from narwhal.engines.dialects.messages import MESSAGES
from narwhal.engines.dialects.openai import CHAT, COMPLETIONS, DEFAULT_ERRORS, GENERATE
from narwhal.engines.dialects.responses import RESPONSES

__all__ = ["CHAT", "COMPLETIONS", "DEFAULT_ERRORS", "GENERATE", "MESSAGES", "RESPONSES", "Dialect"]
