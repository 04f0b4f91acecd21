"""What ``narwhal preflight`` found: per-engine and per-pair verdicts, as a table or as JSON.

Why a separate module: the checks (``narwhal.preflight.check``) talk HTTP; this is the plain data the
CLI prints and the server consumes at start-up (``report.failed_engines()`` → start those
engines ejected). Keeping it free of I/O makes it cheap to import and easy to test.

Verdicts are ``ok``, ``fail`` and ``skip``. A ``skip`` because an engine of the pair failed is
*required* and counts as a failure; a ``skip`` because the pair serves no common model is not
required (placement would never use that pair) and does not fail the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from narwhal.fleet import Fleet

Verdict = Literal["ok", "fail", "skip"]
OK: Verdict = "ok"
FAIL: Verdict = "fail"
SKIP: Verdict = "skip"


@dataclass(slots=True)
class Check:
    """One check of one engine: ``detail`` is the failure reason, or what was observed."""

    verdict: Verdict
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        """The check as the JSON report writes it."""
        return {"verdict": self.verdict, "detail": self.detail}


@dataclass(slots=True, kw_only=True)
class _Verdicted:
    """What an engine's and a pair's result both carry: the verdict, its reason, the time taken."""

    verdict: Verdict = OK
    reason: str = ""
    latency_ms: float | None = None

    def _verdict_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "latency_ms": self.latency_ms}


@dataclass(slots=True)
class EngineResult(_Verdicted):
    """One engine's checks, in the order they ran; its first failure is its reason."""

    name: str
    role: str
    # Insertion order is the order the checks ran: health, version, models, handoff, transfers.
    checks: dict[str, Check] = field(default_factory=dict)
    version: str | None = None  # what /version answered, if it answered
    models: list[str] = field(default_factory=list)  # what /v1/models answered

    @property
    def ok(self) -> bool:
        """Every check of the engine passed."""
        return self.verdict == OK

    def fail(self, check: str, reason: str) -> None:
        """Record a failed check; the first failure decides the engine's reason."""
        self.checks[check] = Check(FAIL, reason)
        if self.verdict != FAIL:
            self.verdict = FAIL
            self.reason = reason

    def to_dict(self) -> dict[str, Any]:
        """The engine as the JSON report writes it."""
        return {
            "name": self.name,
            "role": self.role,
            **self._verdict_dict(),
            "checks": {name: check.to_dict() for name, check in self.checks.items()},
            "version": self.version,
            "models": self.models,
        }


@dataclass(slots=True)
class PairResult(_Verdicted):
    """One producer→consumer transfer check; a pair that is not ``required`` never fails the run."""

    producer: str
    consumer: str
    note: str = ""
    required: bool = True

    @property
    def name(self) -> str:
        """``producer -> consumer``, as the table prints it."""
        return f"{self.producer} -> {self.consumer}"

    @property
    def passed(self) -> bool:
        """OK, or not required (a pair placement would never use)."""
        return self.verdict == OK or not self.required

    def to_dict(self) -> dict[str, Any]:
        """The pair as the JSON report writes it."""
        return {
            "producer": self.producer,
            "consumer": self.consumer,
            **self._verdict_dict(),
            "note": self.note,
            "required": self.required,
        }


@dataclass(slots=True)
class PreflightReport:
    """The result of :func:`narwhal.preflight.check.run_preflight`.

    ``errors`` are fleet-level failures (no engines, no role-permitted pair); ``warnings``
    never fail the run (a descriptor naming ``localhost`` across hosts, an engine no pair uses).
    """

    engines: list[EngineResult] = field(default_factory=list)
    pairs: list[PairResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timeout_s: float = 0.0

    @property
    def ok(self) -> bool:
        """No error, every engine ok and every pair passed: the run's exit status."""
        return (
            not self.errors
            and all(e.ok for e in self.engines)
            and all(p.passed for p in self.pairs)
        )

    def engine(self, name: str) -> EngineResult:
        """The result of the engine called ``name``; ``KeyError`` if none."""
        for result in self.engines:
            if result.name == name:
                return result
        raise KeyError(name)

    def unreachable_engines(self) -> set[str]:
        """The engines no connection could be made to (their health check's reason)."""
        return {e.name for e in self.engines
                if (check := e.checks.get("health")) is not None and check.verdict == FAIL
                and check.detail == "unreachable"}

    def failed_engines(self) -> set[str]:
        """Engines that should not take traffic: a failed check, or charged with failed transfers."""
        return {e.name for e in self.engines if not e.ok}

    def failed_pairs(self) -> set[tuple[str, str]]:
        """The (producer, consumer) pairs that did not pass: placement starts without them."""
        return {(p.producer, p.consumer) for p in self.pairs if not p.passed}

    def to_dict(self) -> dict[str, Any]:
        """The whole report as ``--json`` prints it."""
        return {
            "ok": self.ok,
            "engines": [e.to_dict() for e in self.engines],
            "pairs": [p.to_dict() for p in self.pairs],
            "warnings": list(self.warnings),
            "errors": list(self.errors),
            "timeout_s": self.timeout_s,
        }

    def to_json(self, *, indent: bool = True) -> str:
        """:meth:`to_dict` as JSON text, indented unless ``indent`` is False."""
        option = orjson.OPT_INDENT_2 if indent else 0
        return orjson.dumps(self.to_dict(), option=option).decode()

    def table(self) -> str:
        """One row per engine and per pair, then warnings, errors and a summary line."""
        header = ("KIND", "NAME", "VERDICT", "REASON", "LATENCY_MS", "NOTE")
        rows: list[tuple[str, ...]] = [header]
        for e in self.engines:
            rows.append(("engine", e.name, e.verdict, e.reason or "-", _ms(e.latency_ms), "-"))
        for p in self.pairs:
            rows.append(("pair", p.name, p.verdict, p.reason or "-", _ms(p.latency_ms), p.note or "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
            for row in rows
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"error: {e}" for e in self.errors]
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        """The last line: ok, or how many engines and pairs failed."""
        if self.ok:
            return f"preflight: ok ({len(self.engines)} engines, {len(self.pairs)} pairs)"
        bad_engines = sum(not e.ok for e in self.engines)
        bad_pairs = sum(not p.passed for p in self.pairs)
        return (
            f"preflight: FAILED ({bad_engines} of {len(self.engines)} engines, "
            f"{bad_pairs} of {len(self.pairs)} pairs failed)"
        )


def charge_transfers(fleet: Fleet, report: PreflightReport) -> None:
    """Charge failed transfers to engines as docs/behaviour.md "Recovery" charges crossed-decode failures."""
    failed = [p for p in report.pairs if p.verdict == FAIL]
    for engine in fleet.engines:
        result = report.engine(engine.name)
        probed = [p for p in report.pairs if p.verdict != SKIP and engine.name in (p.producer, p.consumer)]
        if not result.ok or not probed:
            continue
        to = sorted({p.consumer for p in failed if p.producer == engine.name})
        frm = sorted({p.producer for p in failed if p.consumer == engine.name})
        as_producer = engine.name in to or len(to) >= 2 or (bool(to) and len(engine.permitted_consumers) == 1)
        as_consumer = len(frm) >= 2 or (bool(frm) and len(engine.permitted_producers) == 1)
        as_consumer = as_consumer or (engine.name in frm and not as_producer)
        reasons = [f"transfers to {', '.join(to)} failed"] if as_producer else []
        reasons += [f"transfers from {', '.join(frm)} failed"] if as_consumer else []
        if reasons:
            result.fail("transfers", "; ".join(reasons))
        else:
            bad = sum(p.verdict == FAIL for p in probed)
            result.checks["transfers"] = Check(OK, f"{len(probed) - bad} of {len(probed)} ok")


def unused_engines(fleet: Fleet) -> list[str]:
    """A warning per engine that no permitted pair can use (roles, ``kv_peers``, connector)."""
    out = []
    for e in fleet.engines:
        if e.can_prefill and not e.permitted_consumers:
            out.append(f"{e.name}: no role-permitted consumer (check roles, kv_peers and kv_connector)")
        elif e.can_decode and not e.can_prefill and not e.permitted_producers:
            out.append(f"{e.name}: no role-permitted producer (check roles, kv_peers and kv_connector)")
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
