"""Readmission checks run by the supervisor: health checks, lifecycle validation, inference probes.

A probe answers one question — may this engine serve again? — with ``pass``, ``fail`` or
``inconclusive``. Inconclusive means the probe could not decide (the producer it needed is
unavailable, or the producer leg failed): the engine stays out without being blamed again.

* producer probe: a tiny prefill whose descriptor must validate; the handoff is then released
  to a permitted consumer so no KV blocks stay pinned;
* consumer probe: a tiny decode streamed to ``[DONE]``, fed by a new handoff. After a crossed
  decode failure the handoff comes from the *original* producer, so a consumer that cannot
  receive from that producer is not readmitted by a handoff from another one.

Every leg is bounded by ``engine.first_token_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from narwhal.engines.client import EngineClient
from narwhal.engines.connector import PrefillResult
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
        self.session = session
        self.client = EngineClient.for_settings(settings.engine)
        self.admitted = admitted
        self.timeout = settings.engine.first_token_timeout_s
        self._auth = {"Authorization": f"Bearer {settings.engine.api_key}"} if settings.engine.api_key else {}

    async def get(self, engine: Engine, path: str) -> tuple[int, bytes]:
        """(status, body); status 0 when the engine could not be reached in time."""
        try:
            async with asyncio.timeout(self.timeout):
                async with self.session.get(engine.url + path, headers=self._auth) as resp:
                    return resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0, b""

    async def health(self, engine: Engine) -> bool:
        return (await self.get(engine, "/health"))[0] == 200

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
        status, body = await self.get(engine, "/v1/models")
        models = _model_ids(body) if status == 200 else []
        if contract is None:
            return models[0] if models else (next(iter(engine.models), None))
        from narwhal.preflight import check_contract

        pin = check_contract(self.settings)
        if pin is not None:
            status, body = await self.get(engine, "/version")
            version = _field(body, "version") if status == 200 else None
            if not isinstance(version, str) or not pin.matches(version):
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


def _field(body: bytes, key: str) -> Any:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj.get(key) if isinstance(obj, dict) else None


def _model_ids(body: bytes) -> list[str]:
    data = _field(body, "data")
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
