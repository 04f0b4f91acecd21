"""``narwhal preflight``: check every engine against the contract, then every KV transfer.

Why it exists (docs/behaviour.md "Recovery" "Preflight"): a disaggregated fleet fails in ways a health check never
shows — a producer on the wrong vLLM version, a consumer serving another model, a producer whose
descriptors belong to another connector, a NIXL side channel that advertises ``localhost`` to
consumers on other hosts. Each of those only shows up when a real prefill is handed to a real
decode, so preflight does exactly that, once per role-permitted pair, before any user does.

Two phases, each concurrent (bounded by a semaphore):

1. engines: ``/health`` → ``/version``, ``/v1/models`` and whether ``/inference/v1/generate``
   answers 403 (together; a 403 is a warning, docs/decisions.md "vLLM releases") → for producer-capable engines, a tiny
   prefill whose descriptor must validate (NixlConnector profile). The first failing check is
   the engine's reason; later checks are ``skip``.
2. pairs: every producer→consumer pair ``pair_permitted`` allows, of compatible versions and
   transfer modes (docs/decisions.md "vLLM releases": others are skipped, not required, as placement never pairs them),
   gets a fresh tiny prefill and a streamed decode to ``[DONE]`` through :class:`EngineClient`,
   exactly the router's path. At
   the same time the handoffs made in phase 1 are *released* to a healthy consumer, so no KV
   blocks stay pinned until the producer's lease.

Transfer failures are then charged to engines with the rule of docs/behaviour.md "Recovery": a producer whose
handoffs failed on two consumers (or on its only permitted consumer) fails, likewise a consumer
that failed with two producers (or its only one); one broken producer never fails every
consumer. The server calls :func:`run_preflight` at start and ejects ``failed_engines()``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from narwhal.engines import endpoints
from narwhal.engines.client import EngineClient
from narwhal.engines.connector import (
    NIXL,
    InvalidHandoff,
    tp_size_of,
    validate_descriptor,
)
from narwhal.engines.control import (
    SCALE_OUT_REFUSAL,
    ControlClient,
    ControlError,
    VersionPin,
    open_session,
    parse_models,
    parse_version,
)
from narwhal.engines.control_decode import decode_to_end, give_back
from narwhal.engines.prefill_result import PrefillResult
from narwhal.errors import DeadlineExceeded, EngineError, NarwhalError
from narwhal.fleet import Engine, Fleet, compat
from narwhal.preflight import causes
from narwhal.preflight.report import (
    FAIL,
    OK,
    SKIP,
    Check,
    EngineResult,
    PairResult,
    PreflightReport,
    Verdict,
    charge_transfers,
    unused_engines,
)
from narwhal.settings import Settings, load_settings_or_exit

__all__ = ["PreflightReport", "main", "run_preflight"]

T = TypeVar("T")

ENDPOINT = endpoints.PROBE
PROMPT = "narwhal preflight"
MAX_CONCURRENCY = 32  # checks in flight at once: tiny requests, but a 64×64 fleet has 4096 pairs


async def run_preflight(
    settings: Settings, session: aiohttp.ClientSession | None = None, *, timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> PreflightReport:
    """Check every engine and every role-permitted transfer; never raises for engine faults.

    ``timeout`` bounds every single request (default ``engine.first_token_timeout_s``). An
    invalid contract never gets here: the settings refused it. ``progress`` is told one line per
    engine and per pair as each finishes (a long run is never silent until its table).
    """
    pin = VersionPin.of(settings.engine_contract)
    bound = timeout if timeout is not None else settings.engine.first_token_timeout_s
    own = session is None
    active = open_session(settings.engine) if session is None else session
    preflight = _Preflight(settings, active, bound, pin)
    preflight.progress = progress
    try:
        return await preflight.run()
    finally:
        await preflight.client.close()
        if own:
            await active.close()


class _Preflight:
    def __init__(self, settings: Settings, session: aiohttp.ClientSession, timeout: float, pin: VersionPin | None):
        self.settings = settings
        self.control = ControlClient(session, settings.engine, timeout)
        self.timeout = timeout
        self.pin = pin
        self.contract = settings.engine_contract
        self.fleet = Fleet(settings)
        self.specs = {spec.name: spec for spec in settings.engines}
        read_timeout = settings.engine.decode_read_timeout_s
        engine_settings = settings.engine.model_copy(
            update={
                "prefill_timeout_s": timeout,
                "first_token_timeout_s": timeout,
                "decode_read_timeout_s": min(read_timeout, timeout) if read_timeout else timeout,
            }
        )
        self.client = EngineClient.for_settings(engine_settings)
        self.gate = asyncio.Semaphore(MAX_CONCURRENCY)
        self.report = PreflightReport(timeout_s=timeout)
        self.handoffs: dict[str, tuple[PrefillResult, dict[str, Any]]] = {}  # to release
        self.tp: dict[str, int] = {}  # each prefill-capable engine's TP, as its phase-1 descriptor says
        self.progress: Callable[[str], None] | None = None  # told each engine's and pair's line as it ends

    async def run(self) -> PreflightReport:
        report = self.report
        if not self.fleet.engines:
            report.errors.append("no engines configured")
            return report
        report.engines = list(await asyncio.gather(*(self._engine(e) for e in self.fleet.engines)))
        by_name = {r.name: r for r in report.engines}
        await self._handoffs(by_name)
        pairs = [(p, d) for p in self.fleet.engines for d in p.permitted_consumers]
        if not pairs:
            report.errors.append("no role-permitted producer -> consumer pair")
        probes = asyncio.gather(*(self._reported(self._pair(p, d, by_name)) for p, d in pairs))
        results, _ = await asyncio.gather(probes, self._release_all(by_name))
        report.pairs = list(results)
        refusing = [r for r in report.engines if "generate" in r.checks]
        report.warnings += [f"{r.name}: {r.checks['generate'].detail}" for r in refusing]
        report.warnings += [f"{p.name}: {p.note}" for p in report.pairs if p.note]
        charge_transfers(self.fleet, report)
        report.warnings += unused_engines(self.fleet)
        return report

    # ------------------------------------------------------------------ phase 1: engines

    async def _engine(self, engine: Engine) -> EngineResult:
        result = EngineResult(engine.name, engine.role)
        async with self.gate:
            started = time.monotonic()
            await self._check_engine(engine, result)
            result.latency_ms = _ms_since(started)
        if not (engine.can_prefill and result.ok):  # else its line comes after its handoff check
            self._checked(result)
        return result

    def _checked(self, result: EngineResult | PairResult) -> None:
        """One line for the operator as an engine's or a pair's checks end."""
        if self.progress is None:
            return
        what = f"engine {result.name}" if isinstance(result, EngineResult) else f"pair {result.name}"
        took = f" ({result.latency_ms:g} ms)" if result.latency_ms is not None else ""
        self.progress(f"preflight: {what}: {result.verdict}{': ' + result.reason if result.reason else ''}{took}")

    async def _check_engine(self, engine: Engine, result: EngineResult) -> None:
        later = ["version", "models"] + (["handoff"] if engine.can_prefill else [])
        try:
            status, _ = await self.control.get(engine, "/health")
        except ControlError as exc:
            status, reason = 0, exc.reason if exc.reason == "unreachable" else f"health {exc.reason}"
        else:
            reason = f"health {status}"
        if status != 200:
            result.fail("health", reason)
            _skip(result, later)
            return
        result.checks["health"] = Check(OK, "200")
        version, models, generate = await asyncio.gather(
            self._version(engine, result), self._models(engine, result), self._generate(engine))
        for name, check in (("version", version), ("models", models)):
            if check.verdict == FAIL:
                result.fail(name, check.detail)
            else:
                result.checks[name] = check
        if generate is not None:
            result.checks["generate"] = generate
        if engine.can_prefill and not result.ok:
            _skip(result, ["handoff"])
        # A passing producer's handoff check waits for every engine's checks (``_handoffs``).

    async def _handoffs(self, by_name: dict[str, EngineResult]) -> None:
        """Each passing producer's handoff check, once every engine's first checks are in: a
        handoff is made only where a passing consumer could take it back (decode or release it),
        so none waits for a lease (a rolling upgrade's new producer before its consumers answer)."""

        async def one(engine: Engine, result: EngineResult) -> None:
            if not self._release_candidates(engine, by_name):
                result.checks["handoff"] = Check(SKIP, "no passing consumer could take its handoff back")
                return
            async with self.gate:
                started = time.monotonic()
                check = await self._handoff(engine, result)
                result.latency_ms = (result.latency_ms or 0.0) + _ms_since(started)
            if check.verdict == FAIL:
                result.fail("handoff", check.detail)
            else:
                result.checks["handoff"] = check
            self._checked(result)

        await asyncio.gather(*(one(e, by_name[e.name]) for e in self.fleet.engines
                               if e.can_prefill and by_name[e.name].ok))

    async def _read(
        self, engine: Engine, path: str, parse: Callable[[bytes], T | None], what: str, unparsed: str, verdict: Verdict
    ) -> T | Check:
        """``GET path``, parsed; else a ``<what> unreadable: <why>`` check with ``verdict``."""
        try:
            status, data = await self.control.get(engine, path)
        except ControlError as exc:
            return Check(verdict, f"{what} unreadable: {exc.reason}")
        value = parse(data) if status == 200 else None
        if value is None:
            why = f"HTTP {status}" if status != 200 else unparsed
            return Check(verdict, f"{what} unreadable: {why}")
        return value

    async def _version(self, engine: Engine, result: EngineResult) -> Check:
        unreadable = FAIL if self.pin is not None else SKIP
        version = await self._read(engine, "/version", parse_version, "version", "no version in the answer", unreadable)
        if isinstance(version, Check):
            return version
        result.version = version
        # the pairs phase tries compatible pairs only (docs/decisions.md "vLLM releases")
        self.fleet.set_version(engine, version)
        if self.pin is None:
            return Check(OK, f"{version} (not pinned)")
        if not self.pin.matches(version):
            return Check(FAIL, f"version {version} does not match {self.pin.text}")
        return Check(OK, version)

    async def _generate(self, engine: Engine) -> Check | None:
        """docs/decisions.md "vLLM releases": an engine that answers 403 on
        ``/inference/v1/generate`` (vLLM 0.33 without ``--enable-scale-out``) serves everything
        else, so it does not fail; the check is a skip whose detail is the one line the report's
        warnings repeat. None: it serves generate."""
        if await self.control.generate_refused(engine):
            return Check(SKIP, SCALE_OUT_REFUSAL)
        return None

    async def _models(self, engine: Engine, result: EngineResult) -> Check:
        served = await self._read(engine, "/v1/models", parse_models, "models", "not an OpenAI model list", FAIL)
        if isinstance(served, Check):
            return served
        result.models = served
        required = [self.contract.model] if self.contract is not None and self.contract.model else []
        required += [m for m in self.specs[engine.name].models or () if m not in required]
        missing = [m for m in required if m not in served]
        if len(missing) == 1:
            return Check(FAIL, f"model {missing[0]} not served")
        if missing:
            return Check(FAIL, f"models {', '.join(missing)} not served")
        if not served:
            return Check(FAIL, "no model served")
        return Check(OK, ", ".join(served))

    async def _handoff(self, engine: Engine, result: EngineResult) -> Check:
        body = _probe_body(self._models_of(engine, result)[0])
        try:
            handoff = await self.client.prefill(engine, ENDPOINT, body, request_id=_request_id())
        except NarwhalError as exc:
            return Check(FAIL, f"prefill failed: {exc.message}")
        if engine.connector != NIXL:
            if isinstance(handoff.descriptor, dict):
                self.handoffs[engine.name] = (handoff, body)
            return Check(SKIP, f"{engine.connector} descriptors are not validated")
        try:
            validate_descriptor(
                handoff.descriptor, producer=engine.name, prefill_endpoint=ENDPOINT.path, decode_endpoint=ENDPOINT.path
            )
        except InvalidHandoff as exc:
            # sent nowhere (docs/behaviour.md "Cleanup")
            self._abandoned(engine.name, "its descriptor is invalid")
            return Check(FAIL, f"connector mismatch: {exc.message}")
        self.handoffs[engine.name] = (handoff, body)
        if (tp := tp_size_of(handoff.descriptor)) is not None:
            self.tp[engine.name] = tp
        return Check(OK, NIXL)

    def _models_of(self, engine: Engine, result: EngineResult) -> list[str]:
        """The models placement would use this engine for, the contract's first."""
        if self.contract is not None and self.contract.model:
            return [self.contract.model]
        configured = self.specs[engine.name].models
        return list(configured) if configured is not None else result.models

    # ------------------------------------------------------------------ phase 2: pairs

    async def _release_all(self, by_name: dict[str, EngineResult]) -> None:
        await asyncio.gather(*(self._release(name, *item, by_name) for name, item in self.handoffs.items()))

    async def _release(
        self, name: str, handoff: PrefillResult, body: dict[str, Any], by_name: dict[str, EngineResult]
    ) -> None:
        permitted = self._release_candidates(self.fleet.by_name[name], by_name)
        # The first that takes it in time frees it now; else the producer's lease will (abandoned).
        if await give_back(self.client, handoff, body, permitted, self.settings.handoff.max_age_s) == "abandoned":
            self._abandoned(name, "no consumer took it back in time")

    def _release_candidates(self, p: Engine, by_name: dict[str, EngineResult]) -> list[Engine]:
        """The passing consumers a handoff of ``p`` may be released to, in order: its permitted
        compatible ones (a crossed one first: the way traffic goes), else any healthy reader of
        the same connector."""
        permitted = [d for d in p.permitted_consumers if by_name[d.name].ok and compat.compatible(p, d)]
        permitted.sort(key=lambda d: d is p)
        if not permitted:
            permitted = [d for d in self.fleet.engines if d.can_decode and d.connector == p.connector
                         and by_name[d.name].ok and compat.compatible(p, d)]
        return permitted

    async def _reported(self, pair: Awaitable[PairResult]) -> PairResult:
        result = await pair
        self._checked(result)
        return result

    async def _pair(self, p: Engine, d: Engine, by_name: dict[str, EngineResult]) -> PairResult:
        result = PairResult(p.name, d.name)
        failed = [f"{role} {e.name}" for role, e in (("producer", p), ("consumer", d)) if not by_name[e.name].ok]
        if p is d and failed:
            failed = [f"engine {p.name}"]
        if failed:
            result.verdict, result.reason = SKIP, " and ".join(failed) + " failed"
            return result
        common = [m for m in self._models_of(p, by_name[p.name]) if m in self._models_of(d, by_name[d.name])]
        if not common:
            result.verdict, result.reason, result.required = SKIP, "no common model", False
            return result
        if not compat.compatible(p, d):  # NIXL refuses the handshake: placement never pairs them
            result.verdict, result.required = SKIP, False
            result.reason = f"incompatible: {compat.why_incompatible(p, d)}"
            return result
        async with self.gate:
            started = time.monotonic()
            try:
                await self._transfer(p, d, common[0], result, by_name)
            except DeadlineExceeded:
                result.verdict, result.reason = FAIL, (
                    f"transfer failed: {d.name} sent no [DONE] within {self.timeout:g}s (the bound of each "
                    f"preflight request); {_READ_HINT.format(d=d.name)}")
            except NarwhalError as exc:
                result.verdict, result.reason = FAIL, f"transfer failed: {exc.message}"
                if isinstance(exc, EngineError) and exc.engine == d.name and exc.phase == "decode" and p is not d:
                    result.reason += f"; {_READ_HINT.format(d=d.name)}"
            result.latency_ms = _ms_since(started)
        if result.verdict == FAIL and p is not d and compat.tp_multiple_rule(by_name[d.name].version):
            # 0.11's rule only (docs/decisions.md "vLLM releases"): later releases accept heterogeneous TP
            result.reason += causes.tp_cause(p.name, self.tp.get(p.name), d.name, self.tp.get(d.name))
        return result

    async def _transfer(self, p: Engine, d: Engine, model: str, result: PairResult,
                        by_name: dict[str, EngineResult]) -> None:
        """One handoff from ``p`` decoded on ``d`` to ``[DONE]``, under the request path's handoff
        rules (``engines.control_decode``); raises what ended it otherwise."""
        crossed = p is not d  # P = D: a same-worker decode, no descriptor (docs/behaviour.md "The request path", P = D)
        body = _probe_body(model)
        handoff = await self.client.prefill(p, ENDPOINT, body, request_id=_request_id(), crossed=crossed)
        if crossed:
            result.note = causes.localhost_note(p, d, handoff.descriptor)
        deadline = asyncio.get_running_loop().time() + self.timeout
        # Where a handoff d never received may go back: another consumer of p that passed.
        others = [c for c in p.permitted_consumers if c is not d and by_name[c.name].ok and compat.compatible(p, c)]
        # An invalid descriptor raises before any request: it is sent nowhere, as in the router.
        version = by_name[d.name].version  # what its /version said (a consumer below 0.21 keeps refused blocks)
        decoded = await decode_to_end(self.client, handoff, d, {**body, "stream": True}, deadline=deadline,
                                      max_age_s=self.settings.handoff.max_age_s, release_to=others,
                                      frees_refused=lambda exc: compat.frees_refused_decode(version, False,
                                                                                            exc.engine_type))
        if decoded.handoff == "abandoned":
            self._abandoned(p.name, f"{d.name} never received it and no other consumer took it in time")
        elif decoded.handoff == "received" and decoded.error is not None and crossed:
            # Sent, and the consumer failed: it may have read some of it, so nobody else may; a
            # consumer that could not read it leaves it to the producer's lease.
            self._abandoned(p.name, f"{d.name} took it and failed ({decoded.error.reason})")
        if decoded.error is not None:
            raise decoded.error

    def _abandoned(self, producer: str, why: str) -> None:
        """A preflight handoff nobody decoded or released: counted where the operator reads the run
        (a warning; preflight runs in the master before any fork, where no metric may be touched)."""
        self.report.warnings.append(f"{producer}: a preflight handoff was abandoned ({why}): "
                                    "its blocks wait for the producer's lease")


_READ_HINT = ("a consumer that cannot read a handoff (a NIXL handshake or transfer failure) says why only in its "
              "own log: look at {d}'s connector log")


def _skip(result: EngineResult, checks: list[str]) -> None:
    for name in checks:
        result.checks.setdefault(name, Check(SKIP))


def _probe_body(model: str) -> dict[str, Any]:
    return {**endpoints.probe_body(model, PROMPT), "temperature": 0.0}


def _request_id() -> str:
    return f"narwhal-preflight-{uuid.uuid4().hex}"


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)


# ---------------------------------------------------------------------- command line


def main(args: argparse.Namespace) -> int:
    """Exit 0 when every engine and every required pair passed, 1 otherwise, 2 on bad settings."""
    settings = load_settings_or_exit(args.config)
    if args.timeout is not None and not args.timeout > 0:
        print("narwhal preflight: --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run_preflight(settings, timeout=args.timeout, progress=_to_stderr))
    except KeyboardInterrupt:
        return 130
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


def _to_stderr(line: str) -> None:
    """A progress line, on stderr: stdout carries the table (or the JSON report) alone."""
    print(line, file=sys.stderr, flush=True)
