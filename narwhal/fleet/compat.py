"""What Narwhal must know of an engine's vLLM release (docs/decisions.md "vLLM releases"): pure rules, no I/O.

* **Compatible pairs.** NIXL's handshake compares a compatibility hash that includes the exact
  vLLM version string and the transfer mode (``nixl/metadata.py``
  ``compute_nixl_compatibility_hash``): a producer and a consumer of different versions (a
  rolling upgrade) or modes cannot hand off, and every such handoff fails as a failed KV load
  that the breakers would blame on a healthy engine. So a pair is placed only when both modes
  agree and both versions are equal, or when either version is not known yet (an engine whose
  ``/version`` has not been read: refusing it would empty a fleet at start).
* **Who frees a refused decode.** From 0.21.0 on, vLLM's serving layer tells the producer to
  free a handoff whose decode it refused (``_with_kv_transfer_rejection_cleanup``; absent from
  0.20.2, present in 0.21.0, read from both wheels), but only for refusals raised or returned
  inside the chat, completions and responses handlers (Messages goes through chat). It does not
  for a request-validation 400 (FastAPI's handler answers before any handler runs; its error
  ``type`` is ``"Bad Request"``) nor for any refusal on ``/inference/v1/generate``. So Narwhal
  releases a refused handoff exactly when vLLM did not free it (:func:`frees_refused_decode`):
  a consumer below 0.21 or of unknown version, the generate endpoint, or a validation 400. Never
  otherwise: a release after the producer freed the blocks is a late read, the blocks may hold
  another request's KV by then. An unknown version is released: a redundant release costs one
  "Potentially invalid KV blocks" log line on the producer, a missing one pins a prompt's KV for
  the whole lease.
* **0.11's TP rule.** The consumer's TP must be a multiple of the producer's on 0.11.x only;
  later releases accept heterogeneous TP.
* **Endpoints per release.** 0.11 hands off only on chat and completions: its ``ResponsesRequest``
  ignores ``kv_transfer_params`` (extra keys are allowed), so a prefill there answers with no
  handoff; it has no ``/v1/messages`` or ``/inference/v1/generate`` route at all. Later releases
  hand off on every P/D endpoint (:func:`hands_off`, :func:`has_route`).

Why a module of its own: these are facts about vLLM releases that placement (the pair filter, a
future policy's filter), the request path (releases) and preflight (TP hints) all ask; one place
keeps them one answer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

from packaging.version import InvalidVersion, Version

FIRST_REFUSAL_CLEANUP = Version("0.21.0")
_HANDOFF_0_11 = frozenset({"/v1/completions", "/v1/chat/completions"})
_ABSENT_0_11 = frozenset({"/v1/messages", "/inference/v1/generate"})
TRANSFER_MODES = ("pull", "push")


class Described(Protocol):
    """What the rules read of an engine (``fleet.roster.Engine`` has both)."""

    version: str | None  # the engine's /version; None: not read yet
    transfer_mode: str
    enforce_versions: bool  # ``[compat] enforce_versions``: False pairs any two versions


def compatible(producer: Described, consumer: Described) -> bool:
    """May ``producer`` hand off to ``consumer`` (the module's text)? An engine with itself always may."""
    if producer is consumer:
        return True
    if producer.transfer_mode != consumer.transfer_mode:
        return False
    if not (producer.enforce_versions and consumer.enforce_versions):
        return True  # the fleet runs vLLM's enforce_handshake_compat: false (``[compat]``)
    return producer.version is None or consumer.version is None or producer.version == consumer.version


def why_incompatible(producer: Described, consumer: Described) -> str:
    """A few words on why :func:`compatible` said no (for a 503's detail and the log)."""
    if producer.transfer_mode != consumer.transfer_mode:
        return f"transfer modes {producer.transfer_mode} and {consumer.transfer_mode}"
    return f"vLLM {producer.version} and {consumer.version}"


@lru_cache(maxsize=64)
def _parsed(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


VALIDATION_TYPE = "Bad Request"  # the error type of vLLM's request-validation 400s (FastAPI's handler)


def frees_refused_decode(version: str | None, generate: bool = False, error_type: str | None = None) -> bool:
    """Did a consumer of this vLLM version free the handoff whose decode it refused (4xx) itself,
    on this endpoint (``generate``: ``/inference/v1/generate``) with this error ``type``?"""
    if generate or error_type == VALIDATION_TYPE:
        return False
    parsed = None if version is None else _parsed(version)
    return parsed is not None and parsed >= FIRST_REFUSAL_CLEANUP


def tp_multiple_rule(version: str | None) -> bool:
    """Does 0.11's "consumer TP a multiple of the producer's" rule apply (0.11.x only)?"""
    parsed = None if version is None else _parsed(version)
    return parsed is not None and parsed.release[:2] == (0, 11)


def _is_0_11(version: str | None) -> bool:
    parsed = None if version is None else _parsed(version)
    return parsed is not None and parsed.release[:2] == (0, 11)


def hands_off(version: str | None, path: str) -> bool:
    """Can an engine of this release take part in a handoff on the P/D endpoint ``path``? An
    unknown version is taken to (refusing it would empty a fleet whose versions are not read yet)."""
    return not _is_0_11(version) or path in _HANDOFF_0_11


def has_route(version: str | None, path: str) -> bool:
    """Does an engine of this release serve the P/D endpoint ``path`` at all?"""
    return not _is_0_11(version) or path not in _ABSENT_0_11
