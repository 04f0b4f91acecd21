"""Readmission checks run by the supervisor: health checks, lifecycle validation, inference probes.

A probe answers one question — may this engine serve again? — with ``pass``, ``fail`` or
``inconclusive``. Inconclusive means the probe could not decide (the producer it needed is
unavailable, or the producer leg failed): the engine stays out without being blamed again.

* producer probe: a tiny prefill whose descriptor must validate; the handoff is then released
  to a permitted consumer so no KV blocks stay pinned;
* consumer probe: a tiny decode streamed to ``[DONE]``, fed by a new handoff. After a crossed
  decode failure the handoff comes from the *original* producer, so a consumer that cannot
  receive from that producer is not readmitted by a handoff from another one.

Every leg is bounded by ``engine.first_token_timeout_s``. The control reads (``/health``,
``/version``, ``/v1/models``) go through :class:`narwhal.engines.control.ControlClient`, so they
verify engines with ``engine.ca_file`` and send the engine key exactly as the request path does:
a check that cannot reach an engine the request path reaches would eject a healthy fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from narwhal.engines.client import EngineClient
from narwhal.engines.connector import PrefillResult
from narwhal.engines.control import ControlClient, VersionPin
from narwhal.errors import EngineError, NarwhalError
from narwhal.fleet import Engine, Fleet
from narwhal.settings import Settings

ENDPOINT = "/v1/completions"
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


class Prober:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        admitted: Callable[[Engine], bool],
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.client = EngineClient.for_settings(settings.engine)
        self.admitted = admitted
        self.timeout = settings.engine.first_token_timeout_s
        self.control = ControlClient(session, settings.engine, self.timeout)
        self.pin = VersionPin.of(settings.engine_contract)

    async def health(self, engine: Engine) -> bool:
        return await self.control.health(engine)

    async def probe(self, engine: Engine, kind: str, as_producer: bool, as_consumer: bool,
                    producer: str | None) -> str:
        if kind == "health":
            return PASS if await self.health(engine) else FAIL
        model = await self._lifecycle(engine)
        if model is None:
            return FAIL
        if as_producer and not await self._producer_probe(engine, model):
            return FAIL
        if as_consumer:
            return await self._consumer_probe(engine, model, producer)
        return PASS

    async def _lifecycle(self, engine: Engine) -> str | None:
        """With a contract: /health, /version, /v1/models. Returns the model to probe with."""
        contract = self.settings.engine_contract
        if not await self.health(engine):
            return None
        models = await self.control.models(engine) or []
        if contract is None:
            return models[0] if models else (next(iter(engine.models), None))
        if self.pin is not None:
            version = await self.control.version(engine)
            if version is None or not self.pin.matches(version):
                return None
        if contract.model and contract.model not in models:
            return None
        return contract.model or (models[0] if models else None)

    def _body(self, model: str) -> dict[str, Any]:
        return {"model": model, "prompt": "narwhal probe", "max_tokens": 2, "stream": True}

    async def _prefill(self, producer: Engine, model: str, crossed: bool) -> PrefillResult:
        loop = asyncio.get_running_loop()
        return await self.client.prefill(
            producer, ENDPOINT, self._body(model), request_id=_rid(), crossed=crossed,
            deadline=loop.time() + self.timeout,
        )

    async def _producer_probe(self, engine: Engine, model: str) -> bool:
        consumers = [d for d in engine.permitted_consumers if d is not engine and self.admitted(d)]
        crossed = bool(consumers) or engine.role != "both"
        try:
            result = await self._prefill(engine, model, crossed)
        except NarwhalError:
            return False
        if not crossed:
            return True
        from narwhal.engines.connector import validate_descriptor

        try:
            validate_descriptor(result.descriptor, producer=engine.name, prefill_endpoint=ENDPOINT,
                                decode_endpoint=ENDPOINT)
        except EngineError:
            return False
        if consumers:  # give the handoff back: the producer frees its blocks now
            await self.client.release(result, consumers[0], self._body(model))
        return True

    async def _consumer_probe(self, engine: Engine, model: str, original: str | None) -> str:
        if original is not None:
            found = self.fleet.by_name.get(original)
            if found is None or not self.admitted(found):
                return INCONCLUSIVE  # the original producer is unavailable: nothing to learn
            producer = found
        else:
            candidates = [p for p in engine.permitted_producers if p is not engine and self.admitted(p)]
            producer = candidates[0] if candidates else engine
        crossed = producer is not engine
        try:
            result = await self._prefill(producer, model, crossed)
        except NarwhalError:
            return INCONCLUSIVE  # the producer leg failed: nothing learned about the consumer
        loop = asyncio.get_running_loop()
        stream = self.client.decode(result, engine, self._body(model), stream=True,
                                    deadline=loop.time() + self.timeout)
        try:
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    pass
        except EngineError as exc:
            return INCONCLUSIVE if exc.reason == "invalid_handoff" else FAIL
        except NarwhalError:
            return FAIL
        return PASS


def _rid() -> str:
    return "probe-" + uuid.uuid4().hex
