"""End-of-run leak checks of the chaos suite: KV blocks, reservations, fds/RSS, breaker states.

Why an accounting of KV handoffs rather than a bare ``held_blocks == 0``: some faults pin a
producer's blocks *legitimately* until the fake's lease expires, whatever a router does — a
consumer that crashes (``reset``) after taking the handoff, a KV read that fails (producer
stopped or ``kv_read_fails``), a consumer stopped with decodes in flight (their connections cut
before it pulled), a router worker killed between prefill and decode. (A handoff whose consumer
refuses the connection is released through another consumer: docs/behaviour.md "Cleanup".) The check
therefore counts every handoff a producer never saw read (still held + expired by lease, from
the fake's stats) and subtracts the handoffs the fake's request records show were stranded for
one of those reasons. Anything left is a handoff the router produced and neither decoded nor
released: a leak. The lease (60 s) is longer than any run's tail, so a leak cannot hide behind
lease expiry. The records are a bounded list per engine (``--records-max``): with any dropped,
the check says it cannot judge rather than blame the router for what it can no longer see.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from narwhal.testing.harness import FakeFleet
from narwhal.testing.harness import router_roles as harness_roles


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def proc_rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def router_roles(master: int) -> dict[str, list[int]]:
    """master / workers / supervisor, told apart by the titles the processes give themselves."""
    roles = harness_roles(master)
    roles.pop("other", None)
    return roles


def resources(master: int) -> dict[str, list[dict[str, int]]]:
    out: dict[str, list[dict[str, int]]] = {}
    for role, pids in router_roles(master).items():
        out[role] = []
        for pid in pids:
            fds, rss = proc_fds(pid), proc_rss_kb(pid)
            if fds is not None and rss is not None:
                out[role].append({"pid": pid, "fds": fds, "rss_kb": rss})
    return out


def resource_problems(base: dict[str, Any], now: dict[str, Any], max_fds: int, max_rss_kb: int) -> list[str]:
    """Each process now against the largest figure its role had at the start (workers and the
    supervisor may have been replaced by kills and reloads: compare roles, not pids)."""
    problems = []
    for role, procs in now.items():
        if not base.get(role):
            continue
        fds0 = max(p["fds"] for p in base[role])
        rss0 = max(p["rss_kb"] for p in base[role])
        for p in procs:
            if p["fds"] > fds0 + max_fds:
                problems.append(f"{role} {p['pid']}: {p['fds']} fds (start {fds0}, bound +{max_fds})")
            if p["rss_kb"] > rss0 + max_rss_kb:
                problems.append(f"{role} {p['pid']}: RSS {p['rss_kb']} kB (start {rss0}, bound +{max_rss_kb})")
    return problems


def admin_engines(url: str, token: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(url + "/admin/engines", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        engines: list[dict[str, Any]] = json.loads(resp.read())["engines"]
    return engines


def wait_for(pred: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return True
        except OSError:
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)


def _in(windows: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t <= b for a, b in windows)


def _has_stream_error_fault(body: Any) -> bool:
    fake = body.get("narwhal_fake") if isinstance(body, dict) else None
    return bool(isinstance(fake, dict) and isinstance(fake.get("decode"), dict) and fake["decode"].get("stream_error"))


def _descriptor_fault(body: Any, engine: str) -> bool:
    fake = body.get("narwhal_fake") if isinstance(body, dict) else None
    spec = fake.get("prefill") if isinstance(fake, dict) else None
    if not isinstance(spec, dict) or not spec.get("descriptor") or spec["descriptor"] == "localhost":
        return False
    return spec.get("only_engine") in (None, engine)


def _decode_fates(
    fleet: FakeFleet,
    consumers: list[str],
    name_of: dict[str, str],
    unreadable_windows: dict[str, list[tuple[float, float]]],
) -> dict[str, str]:
    """Backend request id -> ``"read"`` (some decode read the handoff) or ``"stranded"`` (every
    decode of it reset, failed its KV pull, or ran while its producer's KV was unreadable)."""
    seen: dict[str, str] = {}
    for c in consumers:
        for rec in fleet.control_request("GET", f"/engines/{c}/requests")["requests"]:
            rid = (rec.get("headers") or {}).get("x-request-id")
            body = rec.get("body")
            if rid is None or rec.get("phase") != "decode" or not isinstance(body, dict):
                continue
            if not isinstance(body.get("kv_transfer_params"), dict):
                continue
            outcome, status = rec.get("outcome"), rec.get("status")
            producer = name_of.get(str(body["kv_transfer_params"].get("remote_engine_id")), "")
            stranded = outcome == "reset" or (
                outcome == "error" and status == 200 and not _has_stream_error_fault(body)  # KV pull failed
            ) or _in(unreadable_windows.get(producer, []), rec["t"])
            if seen.get(rid) != "read":
                seen[rid] = "stranded" if stranded else "read"
    return seen


def kv_accounting(
    fleet: FakeFleet,
    producers: list[str],
    consumers: list[str],
    undelivered_windows: list[tuple[float, float]],
    unreadable_windows: dict[str, list[tuple[float, float]]],
) -> dict[str, Any]:
    """Unread handoffs (held now + expired by lease) against the ones the records excuse.

    ``undelivered_windows`` (wall-clock) are the times a handoff may legitimately never reach a
    consumer: a consumer stopped mid-decode, a router worker killed mid-request.
    ``unreadable_windows`` are, per producer, the times its KV could not be read (stopped, or
    ``kv_read_fails``): a decode or a release that reached a consumer then could not free it.
    """
    unread = 0
    held_blocks = {}
    name_of: dict[str, str] = {}
    for p in producers:
        st = fleet.stats(p)
        held_blocks[p] = st["held_blocks"]
        name_of[st["engine_id"]] = p
        unread += st["held_requests"] + st["expired_requests"]
    # The records are a bounded list per engine: with some dropped, a producer's prefill whose
    # decode record went would look never decoded, and an excuse would be lost.
    dropped = {n: d for n in producers + consumers if (d := fleet.stats(n)["records_dropped"])}
    seen = _decode_fates(fleet, consumers, name_of, unreadable_windows)
    excused = {"consumer_reset_or_kv_unreadable": 0, "never_reached_a_consumer_in_window": 0}
    suspects: list[dict[str, Any]] = []
    for p in producers:
        for rec in fleet.control_request("GET", f"/engines/{p}/requests")["requests"]:
            body = rec.get("body")
            rid = (rec.get("headers") or {}).get("x-request-id")
            if rec.get("phase") != "prefill" or rec.get("outcome") != "completed" or rid is None:
                continue
            if not isinstance(body, dict) or not isinstance(body.get("kv_transfer_params"), dict):
                continue
            if _descriptor_fault(body, p):
                continue  # a corrupted descriptor holds nothing (fake_engine.kv.producer_descriptor)
            state = seen.get(rid)
            if state == "stranded":
                excused["consumer_reset_or_kv_unreadable"] += 1
            elif state is None:
                if _in(undelivered_windows, rec["t"]):
                    excused["never_reached_a_consumer_in_window"] += 1
                elif len(suspects) < 20:
                    suspects.append({"producer": p, "request_id": rid, "t": rec["t"]})
                else:
                    suspects.append({"producer": p, "request_id": rid})
    total_excused = sum(excused.values())
    return {
        "records_dropped": dropped,
        "held_blocks": held_blocks,
        "unread_handoffs": unread,
        "excused": excused,
        "leaked_handoffs": max(0, unread - total_excused),
        "never_decoded_outside_windows": len(suspects),
        "suspects": suspects[:20],
    }


def kv_leaks(kv: dict[str, Any]) -> list[str]:
    """What :func:`kv_accounting` found wrong, one line each (empty: nothing stranded)."""
    if kv["records_dropped"]:
        return [f"the fake's request records were cut ({kv['records_dropped']} dropped, --records-max): "
                "the KV accounting cannot judge"]
    leaks = []
    if kv["leaked_handoffs"]:
        leaks.append(f"{kv['leaked_handoffs']} KV handoffs stranded by the router (held or expired by lease)")
    if kv["never_decoded_outside_windows"]:
        leaks.append(f"{kv['never_decoded_outside_windows']} handoffs never sent to any consumer (neither decoded "
                     f"nor released) outside stop/kill windows: {kv['suspects'][:3]}")
    return leaks


SETTLED_S = 0.5
"""How long every engine must stay admitted to count as admitted at the end: longer than the
supervisor's loop and the chaos router's readmission interval, so the reports of the drive's
last failed requests, merged a few milliseconds after it ended, have been taken into account."""


def admitted_for_a_while(url: str, token: str, engines: list[dict[str, Any]]) -> bool:
    """Every engine admitted, and still admitted :data:`SETTLED_S` later; ``engines`` becomes
    the last view read (what the report shows)."""
    engines[:] = admin_engines(url, token)
    if not all(e["state"] == "admitted" for e in engines):
        return False
    time.sleep(SETTLED_S)
    engines[:] = admin_engines(url, token)
    return all(e["state"] == "admitted" for e in engines)


def final_checks(
    fleet: FakeFleet,
    url: str,
    token: str,
    master: int,
    base: dict[str, Any],
    windows: list[tuple[str, str | None, float, float]],
    producers: list[str],
    consumers: list[str],
    bounds: tuple[int, int],
) -> dict[str, Any]:
    """Run once faults are cleared and engines restarted; ``windows`` are (kind, engine, wall
    start, wall end) of the engine/process faults. Returns ``leaks`` (problems) and details."""
    leaks: list[str] = []
    engines: list[dict[str, Any]] = []
    admitted = wait_for(lambda: admitted_for_a_while(url, token, engines), 20)
    if not admitted:
        leaks.append("engines not admitted at the end: " + ", ".join(f"{e['name']}={e['state']}" for e in engines))
    if not wait_for(lambda: all(e["inflight"] == {"prefill": 0, "decode": 0} for e in admin_engines(url, token)), 10):
        leaks.append("reservations still held: " + ", ".join(f"{e['name']}={e['inflight']}"
                                                            for e in admin_engines(url, token)))
    # Background releases finish within a second or two; the bound stays far under the lease,
    # so a stranded handoff is still held (not expired) when it is counted.
    wait_for(lambda: sum(fleet.stats(p)["held_requests"] for p in producers) == 0, 3)
    undelivered = [(a - 0.5, b + 1.0) for kind, _, a, b in windows if kind in ("stop_consumer", "kill_worker")]
    unreadable: dict[str, list[tuple[float, float]]] = {}
    for kind, engine, a, b in windows:
        if kind in ("stop_producer", "kv_read_fails") and engine:
            unreadable.setdefault(engine, []).append((a - 0.5, b + 0.5))
    kv = kv_accounting(fleet, producers, consumers, undelivered, unreadable)
    leaks += kv_leaks(kv)
    problems: list[str] = []

    def settled() -> bool:
        problems[:] = resource_problems(base, resources(master), *bounds)
        return not problems

    wait_for(settled, 10)
    leaks += problems
    return {"leaks": leaks, "kv": kv, "engines_end": [{k: e[k] for k in ("name", "state", "ejections", "inflight")}
                                                     for e in engines],
            "resources_start": base, "resources_end": resources(master)}
