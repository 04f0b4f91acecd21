"""The placement scenarios' pure parts: the chat workload's prefixes and the report's verdicts."""

from __future__ import annotations

from typing import Any

import orjson

from perf.load.chat import ChatUsers, system_prompts
from perf.load.scenarios import all_scenarios, placement_scenarios, select
from perf.report.placement import table, targets


def test_a_chat_extends_its_own_history_under_one_system_prompt() -> None:
    prompts = system_prompts(4, 4096)
    assert len(set(prompts)) == 4 and all(len(p) == 4096 for p in prompts)
    users = ChatUsers(prompts, turns=3, seed=1)
    bodies = [orjson.loads(users.body(0)) for _ in range(4)]
    first, second, third, fresh = (b["messages"] for b in bodies)
    assert first[0]["role"] == "system" and first[0]["content"] in prompts
    # Every turn starts with the whole previous conversation: the engine's cached prefix.
    assert second[: len(first)] == first and third[: len(second)] == second
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert len(fresh) == 2  # after `turns` turns the user starts a new conversation
    assert all(b["stream"] is True and b["max_tokens"] == 8 for b in bodies)
    other = orjson.loads(users.body(1))["messages"]
    assert other[1] != first[1]  # users do not share their questions


def test_placement_scenarios_run_only_when_named() -> None:
    names = {s.name for s in select(all_scenarios(quick=True, cores=2), None, placement_scenarios(True))}
    assert not names & {"prefix_mix", "busy_elsewhere", "local_short"}
    chosen = select(all_scenarios(quick=True, cores=2), "prefix_mix,local_short", placement_scenarios(True))
    assert [s.name for s in chosen] == ["prefix_mix", "local_short"]
    assert all(s.kind == "placement" for s in chosen)


def _stats(rps: float, p50: float, p99: float, share: float | None = None, cpu: float = 100.0) -> dict[str, Any]:
    return {
        "rps": rps,
        "ttfb_ms": {"p50": p50, "p99": p99},
        "router_ttft_ms": {"p50": p50 / 2, "p99": p99 / 2},
        "cached_share": share,
        "modes": {"disaggregated": 10},
        "errors": {"count": 0},
        "router_cpu_us_per_req": cpu,
    }


def test_placement_targets_are_ratios_between_variants_of_one_run() -> None:
    results = {
        "prefix_mix": {"concurrency": 32, "targets": {
            "affinity": _stats(100.0, 10, 40, 0.9), "no-affinity": _stats(50, 30, 90, 0.3),
        }},
        "busy_elsewhere": {"concurrency": 8, "targets": {"load-on": _stats(10, 5, 60), "load-off": _stats(9, 5, 100)}},
        "local_short": {"concurrency": 32, "targets": {
            "local": _stats(10, 4, 8, cpu=60.0), "disaggregated": _stats(10, 5, 9, cpu=100.0),
        }},
    }
    rows = {t: (figure, verdict) for t, figure, _, verdict in targets(results)}
    assert rows["prefix_mix: cached share with affinity"] == ("0.900 (without: 0.300)", "PASS")
    assert rows["prefix_mix: TTFB p50, affinity ÷ none"] == ("0.333", "PASS")
    assert rows["prefix_mix: TTFB p50, affinity ÷ peer (its best)"] == ("—", "n/a")  # no peer ran
    results["prefix_mix"]["targets"]["peer-cache_aware"] = _stats(80.0, 20, 50)
    results["prefix_mix"]["targets"]["peer-consistent_hash"] = _stats(80.0, 12.5, 50)
    rows = {t: (figure, verdict) for t, figure, _, verdict in targets(results)}
    assert rows["prefix_mix: TTFB p50, affinity ÷ peer-consistent_hash (its best)"] == ("0.800", "PASS")
    assert rows["busy_elsewhere: TTFB p99, load on ÷ off"] == ("0.600", "FAIL")
    assert rows["local_short: router CPU, local ÷ disaggregated"] == ("0.600", "PASS")
    assert rows["local_short: TTFB p50, local ÷ disaggregated"] == ("0.800", "PASS")
    text = "\n".join(table(results))
    assert "## Placement scenarios" in text and "| prefix_mix (c=32) | affinity | 100.0 |" in text
    assert table({}) == []
