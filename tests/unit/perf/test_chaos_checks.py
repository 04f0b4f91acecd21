"""The chaos suite's KV accounting (perf.chaos.checks) judges only from complete records.

Why: the fake keeps a bounded list of request records per engine. A storm overran it: a
producer's oldest prefills then had no decode record left on the consumers and were reported
"never decoded nor released", though every one had been decoded.
"""

from __future__ import annotations

from typing import Any

from perf.chaos.checks import kv_accounting, kv_leaks


class Fleet:
    """Stands in for FakeFleet: one producer's prefill whose decode record the consumer dropped."""

    def __init__(self, dropped: int) -> None:
        self.dropped = dropped

    def stats(self, name: str) -> dict[str, Any]:
        return {"held_blocks": 0, "held_requests": 0, "expired_requests": 0, "engine_id": f"id-{name}",
                "records_dropped": self.dropped if name == "cd0" else 0}

    def control_request(self, method: str, path: str) -> dict[str, Any]:
        if path == "/engines/cp0/requests":
            body = {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}
            return {"requests": [{"phase": "prefill", "outcome": "completed", "t": 1.0, "body": body,
                                  "headers": {"x-request-id": "rid-1"}}]}
        return {"requests": []}


def test_an_accounting_on_cut_records_says_it_cannot_judge_instead_of_blaming_the_router() -> None:
    kv = kv_accounting(Fleet(dropped=1), ["cp0"], ["cd0"], [], {})  # type: ignore[arg-type]
    assert kv["records_dropped"] == {"cd0": 1}
    (leak,) = kv_leaks(kv)
    assert leak.startswith("the fake's request records were cut ({'cd0': 1} dropped")


def test_a_prefill_no_consumer_saw_is_a_leak_when_the_records_are_whole() -> None:
    kv = kv_accounting(Fleet(dropped=0), ["cp0"], ["cd0"], [], {})  # type: ignore[arg-type]
    assert kv["never_decoded_outside_windows"] == 1
    (leak,) = kv_leaks(kv)
    assert leak.startswith("1 handoffs never sent to any consumer")
