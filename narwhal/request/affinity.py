"""What placement learns from the prompt at admission: local decode, and the policy's note (docs/behaviour.md
"Placement").

The prompt text as the engine would see it, from the parsed body: each endpoint's dialect
returns it from its start (``Dialect.affinity_text``: completions ``prompt`` — a string, the
first of a list of strings, or token ids as decimal text; chat each message's role and text
content; responses ``instructions`` + ``input``; messages ``system`` + ``messages``; generate
the token ids' text); an endpoint without prompt text (None) has no note and never decodes
locally.

Invariants, and why:

* The request path has no branch for any placement policy: it hands the policy the prompt
  (:meth:`Policy.prepare <narwhal.fleet.placement.policy.Policy.prepare>`) and carries the note
  it returns unread (``ClientRequest.note``). The policy reads as much of the prompt as its
  rule needs (``affinity``: ``affinity_chars``; ``held``: one past ``max_prefix_chars``;
  ``least_loaded``: nothing), so a 100 KiB prompt costs what its rule reads.
* Local decode is placement's, not a policy's: a prompt shorter than ``local_prefill_chars``
  skips the remote prefill, read to that length only (0, the default: nothing is read), and
  places no producer, so its policy is not asked.
"""

from __future__ import annotations

from typing import Any

from narwhal.engines.endpoints import Endpoint
from narwhal.fleet.placement.policy import Policy
from narwhal.settings import PlacementSettings


def prompt_head(endpoint: Endpoint, body: dict[str, Any], limit: int) -> str | None:
    """The first ``limit`` characters of the prompt text (all of it if shorter); None when the
    endpoint has no prompt text."""
    text = endpoint.dialect.affinity_text(body, limit)
    return None if text is None else text[:limit]


class Prompt:
    """The request's prompt as placement policies read it (``policy.PromptText``): read only as
    far as each asks. A policy may ask where the last answer sits after admission (``held``
    does, at placement): by then admission has encoded the prompt's fields in the body
    (``embed_prompt``), so this keeps a shallow copy of the body as it came (one C call; the
    values themselves are shared, never copied)."""

    __slots__ = ("endpoint", "body")

    def __init__(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        self.endpoint = endpoint
        self.body = dict(body)

    def __call__(self, limit: int) -> str | None:
        return prompt_head(self.endpoint, self.body, limit)

    def answer_span(self, limit: int) -> tuple[int, int] | None:
        """Where the last answer a later turn follows sits in the text (``Dialect.answer_span``)."""
        return self.endpoint.dialect.answer_span(self.body, limit)


def local_decode(endpoint: Endpoint, body: dict[str, Any], settings: PlacementSettings) -> bool:
    """Is the prompt short enough to skip the remote prefill (``local_prefill_chars``)?"""
    local_chars = settings.local_prefill_chars
    if not local_chars:
        return False
    head = prompt_head(endpoint, body, local_chars)
    return head is not None and len(head) < local_chars


def prepared(endpoint: Endpoint, body: dict[str, Any], settings: PlacementSettings, policy: Policy) -> tuple[bool, Any]:
    """(local decode, the policy's note) for one request, each read once."""
    if settings.local_prefill_chars and local_decode(endpoint, body, settings):
        return True, None
    return False, policy.prepare(Prompt(endpoint, body))
