"""The prompt's token ids, for placement by the engines' KV-cache events (docs/behaviour.md "Placement").

An engine's events name the blocks it holds by their token ids; to compare a prompt with them,
placement needs the prompt's ids exactly as the engine will tokenize it (chat template, tools,
special tokens included). They are asked of the engines themselves: one ``POST /tokenize`` to
a producer of the model (vLLM renders chat there with the same ``preprocess_chat`` its chat
endpoint runs), or read from the body where the client sent ids (completions' token prompts,
``/inference/v1/generate``). docs/decisions.md "Token ids from the engine" says why not a
tokenizer in the router, with the figures.

Invariants, and why:

* Asked only when the policy would use them (:meth:`Policy.wants_tokens`: some producer's events
  are followed and the prompt has a block): a fleet without events pays nothing.
* Once per request, before the first placement; retries and continuations reuse the note.
* Never a failure of the request: a ``/tokenize`` that fails, answers something other than a
  list of ids, or takes longer than ``placement.tokenize_timeout_s`` leaves the request placed by
  learned holdings, counted (``narwhal_prompt_token_ids_total{source="failed"}``); no engine
  is charged for it (it is not a leg of the request).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from narwhal import metrics
from narwhal.engines.client import EngineClient
from narwhal.errors import NarwhalError
from narwhal.fleet.placement.policy import Policy
from narwhal.request.admission import ClientRequest
from narwhal.request.slot_wait import WaitingPlacement
from narwhal.settings import PlacementSettings

log = logging.getLogger("narwhal.request")

_SOURCES = ("body", "tokenize", "unsupported", "failed")


class PromptTokens:
    """One worker's asker of token ids (the module's text)."""

    def __init__(self, settings: PlacementSettings, placement: WaitingPlacement, client: EngineClient) -> None:
        self.timeout_s = settings.tokenize_timeout_s
        self.placement = placement
        self.client = client
        self.policy: Policy = placement.policy
        self._counts = {source: metrics.PROMPT_TOKEN_IDS.labels(source) for source in _SOURCES}

    def wanted(self, req: ClientRequest) -> bool:
        """Does the policy want this request's token ids (no coroutine made per request otherwise)?"""
        note = req.note
        return note is not None and not req.local and self.policy.wants_tokens(note)

    async def give(self, req: ClientRequest, request_id: str) -> None:
        """Hand the request's note its prompt's token ids (:meth:`wanted` said it wants them)."""
        note = req.note
        asked = req.endpoint.dialect.token_ids(req.body)
        if isinstance(asked, list):
            self._counts["body"].inc()
            self.policy.tokens(note, asked)
            return
        ids = None if asked is None else await self._tokenize(req, asked, request_id)
        if ids is not None:
            self.policy.tokens(note, ids)

    async def _tokenize(self, req: ClientRequest, asked: dict[str, Any], request_id: str) -> list[int] | None:
        engine = self.placement.tokenizer(req.model)
        if engine is None:
            self._counts["unsupported"].inc()
            return None
        deadline = min(req.deadline, asyncio.get_running_loop().time() + self.timeout_s)
        try:
            _, data, _ = await self.client.passthrough(
                engine, "/tokenize", {"model": req.model, **asked}, request_id=request_id, phase="prefill",
                deadline=deadline)
            answer = orjson.loads(data)
        except (NarwhalError, orjson.JSONDecodeError) as exc:
            self._failed(engine.name, str(exc))
            return None
        ids = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            self._failed(engine.name, "its answer has no list of token ids")
            return None
        self._counts["tokenize"].inc()
        return ids

    def _failed(self, engine: str, why: str) -> None:
        self._counts["failed"].inc()
        log.debug("no token ids from engine %s's /tokenize (%s): placed by learned holdings", engine, why)
