"""Preflight's verdicts as data (``preflight.report``) and its pure rules (``preflight.check``):
which skips fail a run, the table and JSON the CLI prints, how failed transfers are charged to
engines (docs/behaviour.md "Recovery"'s crossed-decode rule), and the notes for localhost descriptors and TP
mismatches. The real runs against fake engines are tests/real_gunicorn/processes/test_preflight.py."""

from __future__ import annotations

import orjson
import pytest

from narwhal.fleet import Fleet
from narwhal.preflight.causes import localhost_note, tp_cause
from narwhal.preflight.report import FAIL, OK, SKIP, EngineResult, PairResult, PreflightReport, charge_transfers
from narwhal.settings import Settings


def _fleet(*engines: tuple[str, str, str]) -> Fleet:
    return Fleet(Settings.model_validate({"engines": [{"name": n, "url": u, "role": r} for n, r, u in engines]}))


def _mesh() -> Fleet:
    """p0, p1 → d0, d1, every pair permitted."""
    return _fleet(("p0", "producer", "http://10.0.0.1:8000"), ("p1", "producer", "http://10.0.0.2:8000"),
                  ("d0", "consumer", "http://10.0.0.3:8000"), ("d1", "consumer", "http://10.0.0.4:8000"))


def _report(fleet: Fleet, failed: set[tuple[str, str]]) -> PreflightReport:
    report = PreflightReport(engines=[EngineResult(name=e.name, role=e.role) for e in fleet.engines])
    for p in ("p0", "p1"):
        for d in ("d0", "d1"):
            report.pairs.append(PairResult(producer=p, consumer=d, verdict=FAIL if (p, d) in failed else OK))
    return report


def test_a_required_skip_fails_the_run_and_an_unrequired_one_does_not() -> None:
    report = PreflightReport(engines=[EngineResult(name="p0", role="producer")],
                             pairs=[PairResult(producer="p0", consumer="d0", verdict=SKIP, required=False)])
    assert report.ok and report.failed_pairs() == set()
    report.pairs.append(PairResult(producer="p0", consumer="d1", verdict=SKIP, reason="consumer d1 failed"))
    assert not report.ok and report.failed_pairs() == {("p0", "d1")}
    assert report.summary() == "preflight: FAILED (0 of 1 engines, 1 of 2 pairs failed)"


def test_an_engines_first_failure_is_its_reason() -> None:
    result = EngineResult(name="d0", role="consumer")
    result.fail("health", "health 503")
    result.fail("models", "model m not served")
    assert result.reason == "health 503" and not result.ok
    assert list(result.checks) == ["health", "models"]


def test_the_table_and_the_json_say_the_same() -> None:
    report = _report(_mesh(), failed={("p0", "d0")})
    report.engine("p0").fail("version", "version 0.10.0 does not match 0.11.0")
    report.warnings.append("d9: no role-permitted producer")
    lines = report.table().splitlines()
    assert lines[0].split() == ["KIND", "NAME", "VERDICT", "REASON", "LATENCY_MS", "NOTE"]
    assert lines[1].split(maxsplit=3)[:3] == ["engine", "p0", "fail"]
    assert lines[-2] == "warning: d9: no role-permitted producer"
    assert lines[-1] == "preflight: FAILED (1 of 4 engines, 1 of 4 pairs failed)"
    doc = orjson.loads(report.to_json())
    assert doc["ok"] is False and doc["engines"][0]["reason"] == "version 0.10.0 does not match 0.11.0"
    assert [(p["producer"], p["consumer"], p["verdict"]) for p in doc["pairs"]][0] == ("p0", "d0", "fail")
    assert report.failed_engines() == {"p0"}


@pytest.mark.parametrize(("failed", "charged"), [
    # one producer's handoffs fail on both consumers: the producer, not the consumers
    ({("p0", "d0"), ("p0", "d1")}, {"p0": "transfers to d0, d1 failed"}),
    # one consumer fails both producers' handoffs: the consumer
    ({("p0", "d0"), ("p1", "d0")}, {"d0": "transfers from p0, p1 failed"}),
    # a single failed pair whose engines both work elsewhere: ambiguous, nobody is charged
    ({("p0", "d0")}, {}),
    (set(), {}),  # nothing failed
])
def test_failed_transfers_are_charged_as_crossed_decodes_are(
    failed: set[tuple[str, str]], charged: dict[str, str]
) -> None:
    fleet = _mesh()
    report = _report(fleet, failed)
    charge_transfers(fleet, report)
    assert {e.name: e.reason for e in report.engines if not e.ok} == charged
    for e in report.engines:
        if e.ok:
            ok = sum(p.verdict == OK for p in report.pairs if e.name in (p.producer, p.consumer))
            assert e.checks["transfers"].detail == f"{ok} of 2 ok"


def test_a_producer_with_a_single_permitted_consumer_is_charged_for_its_one_failure() -> None:
    fleet = _fleet(("p0", "producer", "http://10.0.0.1:8000"), ("d0", "consumer", "http://10.0.0.3:8000"))
    report = PreflightReport(engines=[EngineResult(name="p0", role="producer"),
                                      EngineResult(name="d0", role="consumer")],
                             pairs=[PairResult(producer="p0", consumer="d0", verdict=FAIL)])
    charge_transfers(fleet, report)
    assert report.engine("p0").reason == "transfers to d0 failed"
    assert report.engine("d0").reason == "transfers from p0 failed"


def test_a_localhost_descriptor_is_noted_only_across_hosts() -> None:
    fleet = _mesh()
    p0, d0 = fleet.by_name["p0"], fleet.by_name["d0"]
    note = localhost_note(p0, d0, {"remote_host": "localhost"})
    assert note == ("descriptor remote_host is localhost but p0 and d0 are on different hosts "
                    "(set VLLM_NIXL_SIDE_CHANNEL_HOST on p0)")
    assert localhost_note(p0, d0, {"remote_host": "10.0.0.1"}) == ""
    same = _fleet(("a", "producer", "http://127.0.0.1:1"), ("b", "consumer", "http://[::1]:2"))
    assert localhost_note(same.by_name["a"], same.by_name["b"], {"remote_host": "127.0.0.1"}) == ""


@pytest.mark.parametrize(("p_tp", "d_tp", "says"), [
    (2, 4, ""),  # a multiple: accepted
    (2, 1, "tensor parallel mismatch: p0 runs TP 2, d0 TP 1"),
    (2, None, "likely cause: p0 runs TP 2"),  # the consumer's TP unknown
    (1, None, ""),  # every TP is a multiple of 1
    (None, 1, ""),  # the producer's TP unknown: nothing to say
])
def test_a_tp_mismatch_is_named_only_when_the_sizes_explain_it(p_tp: int | None, d_tp: int | None, says: str) -> None:
    cause = tp_cause("p0", p_tp, "d0", d_tp)
    assert (says in cause) if says else cause == ""
