"""``narwhal preflight`` through the real CLI against a fake fleet (docs/behaviour.md "Recovery" "Preflight"), one of
each vLLM release the fake imitates (0.11.0, then 0.33.0, docs/decisions.md "vLLM releases"), pinned to its version: the
tests are written once; where the releases differ (0.11's TP rule) the test says so.

The fleet is this module's own (``pf-*`` names), so injected faults never disturb the other
modules' routers. Blocks are one token each, so every probe's handoff really holds KV blocks: a
test ends only when every producer holds nothing again, which proves preflight decoded or
released every handoff it made (except where a fault makes the release impossible, and the
short lease cleans up).

Decision recorded here: a producer whose transfers fail on two consumers (``kv_read_fails``) gets
an engine row ``fail`` with reason ``transfers to … failed`` (docs/behaviour.md "Recovery" blame), while a single
failed pair charges no engine: only the pair row fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal.preflight.check import run_preflight
from narwhal.settings import load_settings
from narwhal.testing.harness import FakeFleet, write_config
from tests.real_gunicorn.fixtures import RELEASES
from tests.real_gunicorn.support import wait_until

MODEL = "fake-model"
LEASE_S = 1.5
NAMES = ["pf-p0", "pf-p1", "pf-d0", "pf-d1", "pf-b0"]
ROOT = Path(__file__).resolve().parents[3]
FOUR = [("pf-p0", "producer"), ("pf-p1", "producer"), ("pf-d0", "consumer"), ("pf-d1", "consumer")]
PAIRS = ["pf-p0 -> pf-d0", "pf-p0 -> pf-d1", "pf-p1 -> pf-d0", "pf-p1 -> pf-d1"]
CONTRACT = {"model": MODEL, "kv_connector": "NixlConnector"}  # and the fleet's version, pinned
READ_HINT = ("a consumer that cannot read a handoff (a NIXL handshake or transfer failure) says why only in its own "
             "log: look at {c}'s connector log")
FLEET_ARGS = ["--model", MODEL, "--lease-s", str(LEASE_S), "--block-size", "1", "--enable-scale-out"]


@pytest.fixture(scope="module", params=RELEASES, ids=[f"vllm-{r}" for r in RELEASES])
def pf_fleet(request: pytest.FixtureRequest) -> Iterator[FakeFleet]:
    fleet = FakeFleet.start(NAMES, args=[*FLEET_ARGS, "--vllm-version", request.param])
    yield fleet
    fleet.stop()


@pytest.fixture(autouse=True)
def clean_fleet(pf_fleet: FakeFleet) -> Iterator[None]:
    yield
    for name in NAMES:
        if not pf_fleet.stats(name)["serving"]:
            pf_fleet.control_request("POST", f"/engines/{name}/start")
    pf_fleet.control_request("POST", "/reset")
    for name in NAMES:  # back to this module's release if a test restarted one as another
        if pf_fleet.stats(name)["version"] != pf_fleet.version:
            pf_fleet.control_request("POST", f"/engines/{name}/stop")
            pf_fleet.control_request("POST", f"/engines/{name}/start?restart=1&version={pf_fleet.version}&scale_out=1")
    wait_until(lambda: _held(pf_fleet) == 0, LEASE_S + 5, "every handoff decoded, released or expired")


def _held(fleet: FakeFleet) -> int:
    return sum(fleet.stats(n)["held_requests"] for n in NAMES)


def _config(
    fleet: FakeFleet, tmp_path: Path, engines: list[tuple[str, str]] = FOUR, **sections: dict[str, Any]
) -> str:
    conf: dict[str, dict[str, Any]] = {
        "engine": {"prefill_timeout_s": 3, "first_token_timeout_s": 3, "decode_read_timeout_s": 2},
        "engine_contract": {**CONTRACT, "engine_version": fleet.version},
    }
    for key, values in sections.items():
        conf.setdefault(key, {}).update(values)
    rows = [{"name": n, "url": fleet.engines[n], "role": role} for n, role in engines]
    path = tmp_path / "narwhal.toml"
    shutil.move(write_config(rows, conf), path)
    return str(path)


def _cli(config: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NARWHAL_")}
    cmd = [sys.executable, "-m", "narwhal", "preflight", "--config", config, *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def _rows(stdout: str) -> dict[str, tuple[str, str, str]]:
    """``{"engine pf-p0": (verdict, reason, note), "pair pf-p0 -> pf-d0": ...}`` from the table."""
    lines = stdout.splitlines()
    assert re.split(r"\s{2,}", lines[0].strip()) == ["KIND", "NAME", "VERDICT", "REASON", "LATENCY_MS", "NOTE"]
    rows = {}
    for line in lines[1:]:
        if not line.startswith(("engine ", "pair ")):
            continue
        kind, name, verdict, reason, latency, note = re.split(r"\s{2,}", line.strip())
        assert latency == "-" or float(latency) >= 0
        assert f"{kind} {name}" not in rows
        rows[f"{kind} {name}"] = (verdict, reason, note)
    return rows


def _all_ok(names: list[str], pairs: list[str]) -> dict[str, tuple[str, str, str]]:
    rows = {f"engine {n}": ("ok", "-", "-") for n in names}
    rows.update({f"pair {p}": ("ok", "-", "-") for p in pairs})
    return rows


def _fault(fleet: FakeFleet, name: str, faults: dict[str, Any]) -> None:
    fleet.control_request("PUT", f"/engines/{name}/faults", faults)


def test_all_good_exits_0_with_one_row_per_engine_and_pair(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    proc = _cli(_config(pf_fleet, tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _rows(proc.stdout) == _all_ok(["pf-p0", "pf-p1", "pf-d0", "pf-d1"], PAIRS)
    assert proc.stdout.splitlines()[-1] == "preflight: ok (4 engines, 4 pairs)"
    assert len(proc.stdout.splitlines()) == 10  # header, 4 engines, 4 pairs, summary
    # One line on stderr per engine and per pair as each ends: a long run is never silent.
    progress = proc.stderr.splitlines()
    assert sorted(line.split(": ok")[0] for line in progress) == sorted(
        [f"preflight: engine {n}" for n, _ in FOUR] + [f"preflight: pair {p}" for p in PAIRS])
    assert all(re.fullmatch(r"preflight: (engine|pair) .+: ok \([0-9.]+ ms\)", line) for line in progress)
    # Every handoff was decoded (pairs) or released (the engine checks), not left to the lease.
    assert _held(pf_fleet) == 0
    assert pf_fleet.stats("pf-p0")["requests"]["prefill"] == 3  # 1 engine check + 2 pairs


# One engine failing one check (case, engine, its fault or None to stop it, the engine's reason, its
# pairs' verdict and reason). A failed engine's pairs are skipped; a producer whose own checks pass
# but whose handoffs fail is charged, and its pairs fail (the consumers decoded the other's handoffs).
ONE_ENGINE_FAILS: list[tuple[str, str, dict[str, Any] | None, str, str, str]] = [
    ("version", "pf-p1", {"version": "0.10.0"}, "version 0.10.0 does not match {pin}",
     "skip", "producer pf-p1 failed"),
    ("model", "pf-d0", {"models": ["other-model"]}, "model fake-model not served", "skip", "consumer pf-d0 failed"),
    ("connector", "pf-p0", {"prefill": {"descriptor": "mooncake"}},
     "connector mismatch: invalid handoff: connector mismatch", "skip", "producer pf-p0 failed"),
    ("transfers", "pf-p0", {"kv_read_fails": True}, "transfers to pf-d0, pf-d1 failed",
     "fail", "transfer failed: KV transfer failed; " + READ_HINT.replace("{c}", "{consumer}")),
    ("unreachable", "pf-d1", None, "unreachable", "skip", "consumer pf-d1 failed"),
    ("health_503", "pf-d0", {"health_status": 503}, "health 503", "skip", "consumer pf-d0 failed"),
]


@pytest.mark.parametrize(("case", "engine", "fault", "reason", "pair_verdict", "pair_reason"), ONE_ENGINE_FAILS,
                         ids=[row[0] for row in ONE_ENGINE_FAILS])
def test_one_failing_engine_fails_alone_and_its_pairs_say_why(
    pf_fleet: FakeFleet, tmp_path: Path, case: str, engine: str, fault: dict[str, Any] | None, reason: str,
    pair_verdict: str, pair_reason: str,
) -> None:
    if fault is None:
        pf_fleet.control_request("POST", f"/engines/{engine}/stop")
    else:
        _fault(pf_fleet, engine, fault)
    proc = _cli(_config(pf_fleet, tmp_path))
    assert proc.returncode == 1
    mine = [p for p in PAIRS if engine in p.split(" -> ")]
    expected = _all_ok([n for n, _ in FOUR if n != engine], [p for p in PAIRS if p not in mine])
    expected[f"engine {engine}"] = ("fail", reason.format(pin=pf_fleet.version), "-")
    expected.update({f"pair {p}": (pair_verdict, pair_reason.format(consumer=p.split(" -> ")[1]), "-") for p in mine})
    assert _rows(proc.stdout) == expected
    assert proc.stdout.splitlines()[-1] == "preflight: FAILED (1 of 4 engines, 2 of 4 pairs failed)"


def test_a_consumer_whose_tp_is_no_multiple_of_the_producers_is_named_as_the_cause(
    pf_fleet: FakeFleet, tmp_path: Path
) -> None:
    # vLLM 0.11's NixlConnector refuses a consumer whose TP is not a multiple of
    # the producer's, and its answer says nothing about TP; the fake fails those pulls the same way.
    # Later releases accept heterogeneous TP (docs/decisions.md "vLLM releases"): every pair passes and nothing names
    # TP.
    engines = [("pf-p0", "producer"), ("pf-d0", "consumer"), ("pf-d1", "consumer"), ("pf-b0", "both")]
    tp = {"pf-p0": 2, "pf-d0": 2, "pf-d1": 1, "pf-b0": 1}
    try:
        for name, size in tp.items():
            pf_fleet.set_model(name, tensor_parallel_size=size)
        proc = _cli(_config(pf_fleet, tmp_path, engines))
    finally:
        for name in tp:
            pf_fleet.set_model(name, tensor_parallel_size=1)
    if pf_fleet.version != "0.11.0":
        assert proc.returncode == 0, proc.stdout
        assert _rows(proc.stdout) == _all_ok(["pf-p0", "pf-d0", "pf-d1", "pf-b0"], [
            "pf-p0 -> pf-d0", "pf-p0 -> pf-d1", "pf-p0 -> pf-b0", "pf-b0 -> pf-d0", "pf-b0 -> pf-d1", "pf-b0 -> pf-b0"])
        return
    assert proc.returncode == 1
    rule = "vLLM's NixlConnector needs the consumer's --tensor-parallel-size to be a multiple of the producer's"
    expected = _all_ok(["pf-d0", "pf-d1", "pf-b0"], ["pf-p0 -> pf-d0", "pf-b0 -> pf-d0", "pf-b0 -> pf-d1",
                                                     "pf-b0 -> pf-b0"])
    expected["engine pf-p0"] = ("fail", "transfers to pf-b0, pf-d1 failed", "-")
    # pf-d1 only decodes: its TP is not known to preflight, so the cause is named as likely.
    expected["pair pf-p0 -> pf-d1"] = ("fail", (
        f"transfer failed: KV transfer failed; {READ_HINT.format(c='pf-d1')}; likely cause: pf-p0 runs TP 2 "
        "(its tp_size) and vLLM's "
        "NixlConnector refuses a consumer whose --tensor-parallel-size is not a multiple of it: check pf-d1's"), "-")
    # pf-b0 prefills too: its own descriptor says TP 1, so the mismatch is certain.
    expected["pair pf-p0 -> pf-b0"] = ("fail", (
        f"transfer failed: KV transfer failed; {READ_HINT.format(c='pf-b0')}; tensor parallel mismatch: pf-p0 runs "
        f"TP 2, pf-b0 TP 1: {rule}"), "-")
    assert _rows(proc.stdout) == expected


def test_an_engine_refusing_generate_is_one_warning_and_incompatible_pairs_are_not_tried(
    pf_fleet: FakeFleet, tmp_path: Path
) -> None:
    """docs/decisions.md "vLLM releases": pf-d1 restarted as vLLM 0.32.0 without ``--enable-scale-out`` answers 403 on
    ``/inference/v1/generate``: one warning line names it, and it still passes (it serves every
    other endpoint). Its pairs with the producers of the fleet's release are skipped as
    incompatible, never tried, so no engine is charged and the run passes."""
    pf_fleet.control_request("POST", "/engines/pf-d1/stop")
    pf_fleet.control_request("POST", "/engines/pf-d1/start?restart=1&version=0.32.0&scale_out=0")
    decodes = pf_fleet.stats("pf-d1")["requests"]["decode"]
    proc = _cli(_config(pf_fleet, tmp_path, engine_contract={"engine_version": ">=0.11"}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = _all_ok(["pf-p0", "pf-p1", "pf-d0", "pf-d1"], PAIRS)
    for pair in ("pf-p0 -> pf-d1", "pf-p1 -> pf-d1"):
        expected[f"pair {pair}"] = ("skip", f"incompatible: vLLM {pf_fleet.version} and 0.32.0", "-")
    assert _rows(proc.stdout) == expected
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: pf-d1: answers 403 on /inference/v1/generate: vLLM runs without --enable-scale-out"]
    assert pf_fleet.stats("pf-d1")["incompatible_decodes"] == 0
    assert pf_fleet.stats("pf-d1")["requests"]["decode"] == decodes


def test_json_document(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    _fault(pf_fleet, "pf-p1", {"version": "0.10.0"})
    proc = _cli(_config(pf_fleet, tmp_path), "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert sorted(doc) == ["engines", "errors", "ok", "pairs", "timeout_s", "warnings"]
    assert doc["ok"] is False
    assert doc["timeout_s"] == 3.0
    assert doc["warnings"] == [] and doc["errors"] == []
    summary = [(e["name"], e["role"], e["verdict"], e["reason"]) for e in doc["engines"]]
    assert summary == [
        ("pf-p0", "producer", "ok", ""),
        ("pf-p1", "producer", "fail", f"version 0.10.0 does not match {pf_fleet.version}"),
        ("pf-d0", "consumer", "ok", ""),
        ("pf-d1", "consumer", "ok", ""),
    ]
    p1 = doc["engines"][1]
    assert p1["checks"] == {
        "health": {"verdict": "ok", "detail": "200"},
        "version": {"verdict": "fail", "detail": f"version 0.10.0 does not match {pf_fleet.version}"},
        "models": {"verdict": "ok", "detail": MODEL},
        "handoff": {"verdict": "skip", "detail": ""},
    }
    assert p1["version"] == "0.10.0" and p1["models"] == [MODEL]
    assert doc["engines"][0]["checks"]["handoff"] == {"verdict": "ok", "detail": "NixlConnector"}
    assert doc["engines"][0]["checks"]["transfers"] == {"verdict": "ok", "detail": "2 of 2 ok"}
    assert all(isinstance(e["latency_ms"], float) for e in doc["engines"])
    pairs = [(p["producer"], p["consumer"], p["verdict"], p["reason"]) for p in doc["pairs"]]
    assert pairs == [
        ("pf-p0", "pf-d0", "ok", ""),
        ("pf-p0", "pf-d1", "ok", ""),
        ("pf-p1", "pf-d0", "skip", "producer pf-p1 failed"),
        ("pf-p1", "pf-d1", "skip", "producer pf-p1 failed"),
    ]
    assert [p["latency_ms"] is None for p in doc["pairs"]] == [False, False, True, True]


def test_a_pep440_specifier_pin(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    _fault(pf_fleet, "pf-p0", {"version": "0.10.5"})
    _fault(pf_fleet, "pf-p1", {"version": "0.12.1"})
    _fault(pf_fleet, "pf-d0", {"version": "0.11.1.dev3+g0123abc"})
    _fault(pf_fleet, "pf-d1", {"version": "0.11.0"})
    config = _config(pf_fleet, tmp_path, engine_contract={"engine_version": ">=0.10,<0.12"})
    proc = _cli(config)
    assert proc.returncode == 1
    expected = _all_ok(["pf-p0", "pf-d0", "pf-d1"], PAIRS[:2])
    expected["engine pf-p1"] = ("fail", "version 0.12.1 does not match >=0.10,<0.12", "-")
    expected["pair pf-p1 -> pf-d0"] = ("skip", "producer pf-p1 failed", "-")
    expected["pair pf-p1 -> pf-d1"] = ("skip", "producer pf-p1 failed", "-")
    # Admitted by the pin, yet of other versions than their consumers: never paired (docs/decisions.md "vLLM releases").
    expected["pair pf-p0 -> pf-d0"] = ("skip", "incompatible: vLLM 0.10.5 and 0.11.1.dev3+g0123abc", "-")
    expected["pair pf-p0 -> pf-d1"] = ("skip", "incompatible: vLLM 0.10.5 and 0.11.0", "-")
    assert _rows(proc.stdout) == expected


def test_a_bare_pin_is_met_by_local_builds_of_that_version(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    # CUDA builds of vLLM report 0.11.0+cu126; a pin of 0.11.0 means ==0.11.0,
    # which PEP 440 says they meet. A pin naming a local label is met by that build alone.
    v = pf_fleet.version
    for name in ("pf-p0", "pf-d0"):
        _fault(pf_fleet, name, {"version": f"{v}+cu126"})
    _fault(pf_fleet, "pf-d1", {"version": f"{v}+cu121"})
    proc = _cli(_config(pf_fleet, tmp_path, engines=[FOUR[0], FOUR[2], FOUR[3]]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = _all_ok(["pf-p0", "pf-d0", "pf-d1"], ["pf-p0 -> pf-d0"])
    # Both meet the pin, but NIXL's compatibility hash holds the whole version string: two builds
    # cannot hand off, so the pair is never tried (docs/decisions.md "vLLM releases").
    expected["pair pf-p0 -> pf-d1"] = ("skip", f"incompatible: vLLM {v}+cu126 and {v}+cu121", "-")
    assert _rows(proc.stdout) == expected
    config = _config(pf_fleet, tmp_path, engines=[FOUR[0], FOUR[2], FOUR[3]],
                     engine_contract={"engine_version": f"{v}+cu126"})
    proc = _cli(config)
    assert proc.returncode == 1
    expected = _all_ok(["pf-p0", "pf-d0"], ["pf-p0 -> pf-d0"])
    expected["engine pf-d1"] = ("fail", f"version {v}+cu121 does not match {v}+cu126", "-")
    expected["pair pf-p0 -> pf-d1"] = ("skip", "consumer pf-d1 failed", "-")
    assert _rows(proc.stdout) == expected


def test_an_invalid_specifier_is_an_invalid_setting(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    proc = _cli(_config(pf_fleet, tmp_path, engine_contract={"engine_version": ">=zero"}))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        "narwhal: invalid settings: engine_contract.engine_version: invalid PEP 440 specifier '>=zero'\n"
    )


def test_same_worker_pair_and_a_short_timeout(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    engines = [("pf-b0", "both"), ("pf-d0", "consumer")]
    proc = _cli(_config(pf_fleet, tmp_path, engines))
    assert proc.returncode == 0, proc.stdout
    assert _rows(proc.stdout) == _all_ok(["pf-b0", "pf-d0"], ["pf-b0 -> pf-b0", "pf-b0 -> pf-d0"])
    same = pf_fleet.control_request("GET", "/engines/pf-b0/requests")["requests"]
    # The engine check's and the crossed pair's prefills ask for a descriptor; the same-worker
    # prefill must not (docs/behaviour.md "Prefill").
    prefills = sorted("kv_transfer_params" in r["body"] for r in same if r["phase"] == "prefill")
    assert prefills == [False, True, True]

    _fault(pf_fleet, "pf-d0", {"decode": {"delay_first_token_s": 2}})
    proc = _cli(_config(pf_fleet, tmp_path, engines), "--timeout", "0.5")
    assert proc.returncode == 1
    rows = _rows(proc.stdout)
    assert rows["pair pf-b0 -> pf-d0"] == ("fail", "transfer failed: pf-d0 sent no [DONE] within 0.5s (the bound of "
                                           f"each preflight request); {READ_HINT.format(c='pf-d0')}", "-")
    assert rows["pair pf-b0 -> pf-b0"] == ("ok", "-", "-")
    assert rows["engine pf-d0"] == ("fail", "transfers from pf-b0 failed", "-")  # its only producer
    assert rows["engine pf-b0"] == ("ok", "-", "-")


def test_no_permitted_pair_is_an_error(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    proc = _cli(_config(pf_fleet, tmp_path, [("pf-d0", "consumer"), ("pf-d1", "consumer")]))
    assert proc.returncode == 1
    assert _rows(proc.stdout) == _all_ok(["pf-d0", "pf-d1"], [])
    assert proc.stdout.splitlines()[-4:] == [
        "warning: pf-d0: no role-permitted producer (check roles, kv_peers and kv_connector)",
        "warning: pf-d1: no role-permitted producer (check roles, kv_peers and kv_connector)",
        "error: no role-permitted producer -> consumer pair",
        "preflight: FAILED (0 of 2 engines, 0 of 0 pairs failed)",
    ]


async def test_the_python_api(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    _fault(pf_fleet, "pf-p0", {"kv_read_fails": True})
    _fault(pf_fleet, "pf-d1", {"models": ["other-model"]})
    report = await run_preflight(load_settings(_config(pf_fleet, tmp_path), environ={}), timeout=2)
    assert report.ok is False
    # pf-p0's only probed transfer failed, but it has two permitted consumers: not charged.
    assert report.failed_engines() == {"pf-d1"}
    assert report.failed_pairs() == {
        ("pf-p0", "pf-d0"), ("pf-p0", "pf-d1"), ("pf-p1", "pf-d1")
    }
    assert report.engine("pf-p0").checks["transfers"].detail == "0 of 1 ok"
    assert json.loads(report.to_json())["ok"] is False


def _outbound_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # no packet is sent: this only picks a source address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_localhost_descriptor_across_hosts_is_a_warning(tmp_path: Path) -> None:
    address = _outbound_ipv4()
    if address is None:
        pytest.skip("no non-loopback IPv4 address to stand for a second host")
    fleet = FakeFleet.start(["pf-lp0", "pf-ld0"], args=[*FLEET_ARGS, "--host", "0.0.0.0"])
    try:
        _fault(fleet, "pf-lp0", {"prefill": {"descriptor": "localhost"}})
        d_url = fleet.engines["pf-ld0"].replace("127.0.0.1", address)
        rows = [
            {"name": "pf-lp0", "url": fleet.engines["pf-lp0"], "role": "producer"},
            {"name": "pf-ld0", "url": d_url, "role": "consumer"},
        ]
        path = tmp_path / "narwhal.toml"
        shutil.move(write_config(rows, {"engine_contract": CONTRACT}), path)
        proc = _cli(str(path))
        note = (
            "descriptor remote_host is localhost but pf-lp0 and pf-ld0 are on different hosts "
            "(set VLLM_NIXL_SIDE_CHANNEL_HOST on pf-lp0)"
        )
        assert proc.returncode == 0, proc.stdout  # a warning, not a failure
        assert _rows(proc.stdout)["pair pf-lp0 -> pf-ld0"] == ("ok", "-", note)
        assert f"warning: pf-lp0 -> pf-ld0: {note}" in proc.stdout.splitlines()
        doc = json.loads(_cli(str(path), "--json").stdout)
        assert doc["warnings"] == [f"pf-lp0 -> pf-ld0: {note}"]
        assert doc["pairs"][0]["note"] == note
    finally:
        fleet.stop()


def test_no_handoff_is_made_where_no_passing_consumer_could_take_it_back(pf_fleet: FakeFleet, tmp_path: Path) -> None:
    """A rolling upgrade's new producer checked before its consumers answer: its handoff check
    is skipped rather than leaving a handoff pinned for the producer's lease."""
    pf_fleet.control_request("POST", "/engines/pf-d0/stop")
    before = pf_fleet.stats("pf-p0")["requests"]["prefill"]
    proc = _cli(_config(pf_fleet, tmp_path, [("pf-p0", "producer"), ("pf-d0", "consumer")]))
    assert proc.returncode == 1
    assert _rows(proc.stdout)["engine pf-p0"] == ("ok", "-", "-")
    assert pf_fleet.stats("pf-p0")["requests"]["prefill"] == before and _held(pf_fleet) == 0  # none made
    assert "preflight: engine pf-d0: fail: unreachable" in proc.stderr
