"""What placement learns from the prompt at admission: the affinity key and local decode (docs/behaviour.md
"Placement").

The prompt text as the engine would see it, from the parsed body: each endpoint's dialect
returns it from its start (``Dialect.affinity_text``: completions ``prompt`` — a string, the
first of a list of strings, or token ids as decimal text; chat each message's role and text
content; responses ``instructions`` + ``input``; messages ``system`` + ``messages``; generate
the token ids' text); an endpoint without prompt text (None) has no key and never decodes
locally.

Invariants, and why:

* Computed once per request, reading at most ``max(affinity_chars, local_prefill_chars)``
  characters: a 100 KiB prompt costs what a 1 KiB one does.
* Short prompts cost nothing: under ``affinity_min_chars`` there is no key and nothing is
  hashed; with affinity off and ``local_prefill_chars = 0`` nothing is read at all.
* The key is the 64-bit BLAKE2b of the first ``affinity_chars`` characters
  (``narwhal.fleet.placement.affinity.key_hash``): the same in every worker and replica.
"""

from __future__ import annotations

from typing import Any

from narwhal.engines.endpoints import Endpoint
from narwhal.fleet.placement.affinity import key_hash
from narwhal.fleet.placement.blocks import KeyMemo, PrefixBlocks
from narwhal.fleet.placement.policy import Policy
from narwhal.settings import PlacementSettings


def prompt_head(endpoint: Endpoint, body: dict[str, Any], limit: int) -> str | None:
    """The first ``limit`` characters of the prompt text (all of it if shorter); None when the
    endpoint has no prompt text."""
    text = endpoint.dialect.affinity_text(body, limit)
    return None if text is None else text[:limit]


def request_hints(
    endpoint: Endpoint, body: dict[str, Any], settings: PlacementSettings, policy: Policy, memo: KeyMemo | None = None
) -> tuple[int | None, bool, PrefixBlocks | None]:
    """(the affinity key, local decode, the prefix blocks) as the placement ``policy`` wants
    them: the request path asks what it wants, never which policy it is."""
    if policy.wants_blocks:
        return block_hints(endpoint, body, settings, memo)
    key, local = placement_hints(endpoint, body, settings, keyed=policy.wants_key)
    return key, local, None


def block_hints(
    endpoint: Endpoint, body: dict[str, Any], settings: PlacementSettings, memo: KeyMemo | None = None
) -> tuple[int | None, bool, PrefixBlocks | None]:
    """For a policy that wants the prompt's blocks (``held``): (the affinity key, local decode,
    the prefix blocks) from one read of the prompt text. A prompt with a full block places by its
    blocks and needs no key; a shorter one keeps the affinity key (the affinity rule places it).
    ``memo``: the worker's block keys already computed (the same keys, fewer hashes)."""
    local_chars = settings.local_prefill_chars
    limit = max(settings.max_prefix_chars + 1, local_chars)
    head = prompt_head(endpoint, body, limit)
    if head is None:
        return None, False, None
    size = len(head)
    if size < local_chars:
        return None, True, None
    if size >= settings.block_chars:
        return None, False, PrefixBlocks(head, settings.block_chars, settings.max_prefix_chars, memo)
    if size < settings.affinity_min_chars:
        return None, False, None
    return key_hash(head[: settings.affinity_chars]), False, None


def prefix_blocks(endpoint: Endpoint, body: dict[str, Any], settings: PlacementSettings) -> PrefixBlocks | None:
    """The prompt's prefix blocks for policy ``held`` (docs/behaviour.md "Placement"), None when it has no full block.

    The text is read to one character past ``max_prefix_chars``, so a reporter can tell a whole
    prompt (its length gives characters per token) from a cut one; keys are computed lazily."""
    head = prompt_head(endpoint, body, settings.max_prefix_chars + 1)
    if head is None or len(head) < settings.block_chars:
        return None
    return PrefixBlocks(head, settings.block_chars, settings.max_prefix_chars)


def placement_hints(
    endpoint: Endpoint, body: dict[str, Any], settings: PlacementSettings, *, keyed: bool = True
) -> tuple[int | None, bool]:
    """(the affinity key's hash or None, whether to decode locally) for one request; ``keyed``:
    the policy wants the key (else only local decode is looked for)."""
    local_chars = settings.local_prefill_chars
    if not keyed and local_chars == 0:
        return None, False
    limit = max(settings.affinity_chars, local_chars)
    head = prompt_head(endpoint, body, limit)
    if head is None:
        return None, False
    local = len(head) < local_chars
    if local or not keyed or len(head) < settings.affinity_min_chars:
        return None, local
    return key_hash(head[: settings.affinity_chars]), False
