"""Readmission checks run by the supervisor: health checks, lifecycle validation, inference probes.

A probe answers one question — may this engine serve again? — with ``pass``, ``fail`` or
``inconclusive``, and says why in a few words (``HTTP 503``, ``unreachable``, ``timed out
after 2s``, ``engine_5xx: ...``) for the supervisor's log line. Inconclusive means the probe
could not decide (the producer it needed is unavailable, or the producer leg failed): the
engine stays out without being blamed again.

* producer probe: a tiny prefill whose descriptor must validate; the handoff is then released
  to a permitted consumer so no KV blocks stay pinned;
* consumer probe: a tiny decode streamed to ``[DONE]``, fed by a new handoff. After a crossed
  decode failure the handoff comes from the *original* producer, so a consumer that cannot
  receive from that producer is not readmitted by a handoff from another one.

Probes pair like placement (docs/behaviour.md, "Recovery": probes pair like placement): a probe's partner, and the
consumer a producer probe's handoff is released to, can hand off with the probed engine: the same
transfer mode, and the same vLLM version when both are known (the probed engine's version is read
by the probe itself, so a freshly upgraded engine is never paired by a stale one). Partners of
its own known version come first. Without this, a rolling upgrade readmits nothing: a 0.33
consumer probed through a 0.32 producer listed first fails NIXL's handshake every time, and stays
out until that producer is upgraded too.

Every leg is bounded by ``engine.first_token_timeout_s``. The control reads (``/health``,
``/version``, ``/v1/models``) go through :class:`narwhal.engines.control.ControlClient`, so they
verify engines with ``engine.ca_file`` and send the engine key exactly as the request path does:
a check that cannot reach an engine the request path reaches would eject a healthy fleet.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from narwhal import metrics
from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.engines.control import ControlClient, ControlError, VersionPin
from narwhal.engines.control_decode import decode_to_end, give_back
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import EngineError, NarwhalError
from narwhal.fleet import Engine, Fleet, compat
from narwhal.reasons import Reason
from narwhal.settings import Settings

ENDPOINT = endpoints.PROBE
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
Verdict = tuple[str, str]  # (pass | fail | inconclusive, why: "" for a pass)


def _why(exc: NarwhalError) -> str:
    return f"{exc.reason}: {exc.message}"


class Prober:
    """Runs the supervisor's health checks and readmission probes; every leg bounded by the first-token timeout."""

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
        """Did ``GET /health`` answer 200?"""
        return await self.health_failure(engine) is None

    async def health_failure(self, engine: Engine) -> str | None:
        """None when ``GET /health`` answered 200, else why not."""
        try:
            status, _ = await self.control.get(engine, "/health")
        except ControlError as exc:
            return exc.reason
        return None if status == 200 else f"HTTP {status}"

    async def probe(self, engine: Engine, kind: str, as_producer: bool, as_consumer: bool,
                    producer: str | None) -> Verdict:
        """The verdict of one probe of ``kind`` and why: health, lifecycle, then the producer and consumer legs."""
        if kind == "health":
            failure = await self.health_failure(engine)
            return (PASS, "") if failure is None else (FAIL, failure)
        model, why, version = await self._lifecycle(engine)
        if model is None:
            return FAIL, why
        if kind == "lifecycle":  # a discovered engine's first checks without a contract (supervisor.membership)
            return PASS, ""
        probed = _Probed(version or engine.version, engine.transfer_mode, engine.enforce_versions)
        if as_producer:
            why = await self._producer_probe(engine, probed, model)
            if why:
                return FAIL, why
        if as_consumer:
            return await self._consumer_probe(engine, probed, model, producer)
        return PASS, ""

    async def _lifecycle(self, engine: Engine) -> tuple[str | None, str, str | None]:
        """With a contract: /health, /version, /v1/models. Returns the model to probe with (or
        None and why not), and the version the engine reported (None: not read or unreadable)."""
        contract = self.settings.engine_contract
        failure = await self.health_failure(engine)
        if failure is not None:
            return None, f"health: {failure}", None
        models = await self.control.models(engine) or []
        if contract is None:
            model = models[0] if models else (next(iter(engine.models), None))
            return model, "" if model else "no model to probe with", None
        version = await self.control.version(engine)  # read for the pin, and to pair the probe (module text)
        if self.pin is not None and (version is None or not self.pin.matches(version)):
            return None, f"version {version or 'unreadable'} does not meet the pin", version
        if contract.model and contract.model not in models:
            return None, f"model {contract.model} not served", version
        model = contract.model or (models[0] if models else None)
        return model, "" if model else "no model to probe with", version

    def _partners(self, candidates: tuple[Engine, ...], engine: Engine, probed: _Probed,
                  probed_is_producer: bool) -> list[Engine]:
        """The admitted ``candidates`` that can hand off with the probed engine, those of its own
        known version first (module text)."""
        found = []
        for other in candidates:
            if other is engine or not self.admitted(other):
                continue
            pair = (probed, other) if probed_is_producer else (other, probed)
            if compat.compatible(*pair):
                found.append(other)
        return sorted(found, key=lambda other: other.version is None or other.version != probed.version)

    def _body(self, model: str) -> dict[str, Any]:
        return {**endpoints.probe_body(model, "narwhal probe"), "stream": True}

    async def _prefill(self, producer: Engine, model: str, crossed: bool) -> PrefillResult:
        loop = asyncio.get_running_loop()
        return await self.client.prefill(
            producer, ENDPOINT, self._body(model), request_id=_rid(), crossed=crossed,
            deadline=loop.time() + self.timeout,
        )

    async def _producer_probe(self, engine: Engine, probed: _Probed, model: str) -> str:
        """"" when the engine's handoff validated, else why not."""
        consumers = self._partners(engine.permitted_consumers, engine, probed, probed_is_producer=True)
        crossed = bool(consumers) or engine.role != "both"
        try:
            result = await self._prefill(engine, model, crossed)
        except NarwhalError as exc:
            return f"prefill: {_why(exc)}"
        if not crossed:
            return ""
        from narwhal.engines.connector import validate_descriptor

        try:
            validate_descriptor(result.descriptor, producer=engine.name, prefill_endpoint=ENDPOINT.path,
                                decode_endpoint=ENDPOINT.path)
        except EngineError as exc:
            return exc.message
        # Give the handoff back (the producer frees its blocks now), else it is abandoned.
        metrics.count_handoff_fate(await give_back(self.client, result, self._body(model), consumers,
                                                   self.settings.handoff.max_age_s))
        return ""

    async def _consumer_probe(self, engine: Engine, probed: _Probed, model: str, original: str | None) -> Verdict:
        found = None if original is None else self.fleet.by_name.get(original)
        if found is not None and not compat.compatible(found, probed):
            found = None  # an upgraded pair: the original producer cannot hand off to it any more
        elif original is not None:
            if found is None or not self.admitted(found):
                return INCONCLUSIVE, f"original producer {original} unavailable"  # nothing to learn
        if found is not None:
            producer = found
        else:
            candidates = self._partners(engine.permitted_producers, engine, probed, probed_is_producer=False)
            producer = candidates[0] if candidates else engine
        crossed = producer is not engine
        try:
            result = await self._prefill(producer, model, crossed)
        except NarwhalError as exc:  # the producer leg failed: nothing learned about the consumer
            return INCONCLUSIVE, f"prefill on {producer.name}: {_why(exc)}"
        loop = asyncio.get_running_loop()
        others = [c for c in producer.permitted_consumers  # where a handoff it never received may go back
                  if c is not engine and self.admitted(c) and compat.compatible(producer, c)] if crossed else []
        decoded = await decode_to_end(self.client, result, engine, self._body(model),
                                      deadline=loop.time() + self.timeout, max_age_s=self.settings.handoff.max_age_s,
                                      release_to=others,
                                      frees_refused=lambda exc: compat.frees_refused_decode(
                                          engine.version, False, exc.engine_type))
        metrics.count_handoff_fate(decoded.handoff)
        failed = decoded.error
        if failed is None:
            return PASS, ""
        if isinstance(failed, EngineError) and failed.reason in (Reason.INVALID_HANDOFF, Reason.HANDOFF_EXPIRED):
            return INCONCLUSIVE, f"decode: {_why(failed)}"  # the producer's handoff, not this consumer
        return FAIL, f"decode: {_why(failed)}"


class _Probed:
    """The probed engine as the pairing rule reads it: its version as the probe read it, and its mode."""

    __slots__ = ("version", "transfer_mode", "enforce_versions")

    def __init__(self, version: str | None, transfer_mode: str, enforce_versions: bool) -> None:
        self.version = version
        self.transfer_mode = transfer_mode
        self.enforce_versions = enforce_versions


def _rid() -> str:
    return "probe-" + uuid.uuid4().hex
