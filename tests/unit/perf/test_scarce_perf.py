"""prefix_scarce's pure parts: the workload's Zipf and multi-turn shape, the ideal assignment and
its requests, the per-producer figures, the scenario's target checks, and the load loop's alternation."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest
from aiohttp import web

from perf.load.chat import ChatUsers, run_users, system_prompts, zipf_weights
from perf.load.generator import PREFILL_KV
from perf.load.scarce import VARIANTS, IdealLegs, ideal_assignment, producer_figures
from perf.load.scenarios import SCARCE_ROWS, all_scenarios, placement_scenarios, scarce_scenarios, select
from perf.main import parse_args
from perf.report.scarce import table, targets, variant_targets


def test_zipf_weights_are_uniform_at_zero_and_fall_as_k_to_the_minus_s() -> None:
    assert zipf_weights(8, 0.0) == [0.125] * 8
    w = zipf_weights(8, 1.1)
    assert sum(w) == pytest.approx(1.0)
    assert [w[0] / x for x in w] == pytest.approx([(k + 1) ** 1.1 for k in range(8)])
    assert w[0] == pytest.approx(0.398, abs=0.001)  # the head prompt: ~40 % of the chats


def _chats(users: ChatUsers, requests: int) -> list[tuple[int, int]]:
    """(system prompt, turns) of every chat user 0 finished, from the bodies it sent."""
    out: list[tuple[int, int]] = []
    system, turns = -1, 0
    for _ in range(requests):
        messages = users.data(0)["messages"]
        if len(messages) == 2:  # system + the first question: a new chat began
            if turns:
                out.append((system, turns))
            system, turns = users.system_of(0), 0
        turns += 1
        assert len(messages) == 2 * turns  # system, then question/answer pairs, then the question
    return out


def test_chats_are_30_percent_multi_turn_of_at_most_5_turns_with_zipf_prompts() -> None:
    prompts = system_prompts(8, 4000)
    assert all(len(p) == 4000 for p in prompts)
    users = ChatUsers(prompts, turns=5, seed=3, weights=zipf_weights(8, 1.1), multi_turn=0.3)
    chats = _chats(users, 20000)
    lengths = Counter(t for _, t in chats)
    assert set(lengths) == {1, 2, 3, 4, 5}
    multi = sum(n for t, n in lengths.items() if t > 1) / len(chats)
    assert multi == pytest.approx(0.3, abs=0.02)
    # Multi-turn chats are 2..5 turns, uniform.
    multi_chats = sum(lengths[k] for k in (2, 3, 4, 5))
    assert all(lengths[t] / multi_chats == pytest.approx(0.25, abs=0.04) for t in (2, 3, 4, 5))
    # Popularity follows the weights (a chat picks its prompt once, at its start).
    picked = Counter(s for s, _ in chats)
    shares = [picked[i] / len(chats) for i in range(8)]
    assert shares == pytest.approx(zipf_weights(8, 1.1), abs=0.02)


def test_default_chats_keep_prefix_mix_shape() -> None:
    users = ChatUsers(system_prompts(4, 4096), turns=6, seed=1)
    assert {t for _, t in _chats(users, 60)} == {6}


def test_the_ideal_assignment_balances_traffic_over_rate_two_prompts_each() -> None:
    uniform = ideal_assignment(zipf_weights(8, 0.0), [1.0] * 4)
    assert uniform == [0, 1, 2, 3, 0, 1, 2, 3]
    zipf = zipf_weights(8, 1.1)
    # Heaviest first; the head prompt (40 %) is paired with the lightest, as no producer holds 3.
    assert ideal_assignment(zipf, [1.0] * 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    slow = ideal_assignment(zipf, [1.0, 1.0, 1.0, 0.5])
    traffic = [sum(w for w, j in zip(zipf, slow, strict=True) if j == k) for k in range(4)]
    assert sorted(Counter(slow).values()) == [2, 2, 2, 2]
    assert traffic[3] == min(traffic) and traffic[3] < 0.5 * sum(traffic[:3]) / 3  # the slow one gets less
    assert VARIANTS["prefix_scarce_slow"].rates() == [1.0, 1.0, 1.0, 0.5]


def test_the_slow_variant_runs_p3_at_twice_the_cost_per_token() -> None:
    args = VARIANTS["prefix_scarce_slow"].producer_args()
    assert args[args.index("--kv-blocks") + 1] == "160" and args[args.index("--max-num-seqs") + 1] == "4"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--prefill-us-per-token"] == ["20", "p3=40"]
    assert "p3=40" not in VARIANTS["prefix_scarce_uniform"].producer_args()


def test_ideal_legs_prefill_on_the_assigned_producer_and_decode_on_the_users_consumer() -> None:
    users = ChatUsers(system_prompts(8, 4000), turns=5, seed=2, multi_turn=0.3)
    assignment = [0, 0, 1, 1, 2, 2, 3, 3]
    legs = IdealLegs(users, [f"http://p{i}" for i in range(4)], ["http://d0", "http://d1"], assignment)
    decode_url, pd = legs(3)
    system = users.system_of(3)
    assert decode_url == "http://d1/v1/chat/completions"
    assert pd.prefill_url == f"http://p{assignment[system]}/v1/chat/completions"
    prefill = orjson.loads(pd.prefill_body)
    assert prefill["stream"] is False and prefill["max_tokens"] == 1 and prefill["kv_transfer_params"] == PREFILL_KV
    assert prefill["messages"] == pd.decode["messages"] and pd.decode["stream"] is True
    assert "kv_transfer_params" not in pd.decode


def test_producer_figures_give_shares_and_the_slow_ones_ratio() -> None:
    counts = {"p0": [30, 1000, 900], "p1": [30, 1000, 800], "p2": [30, 0, 0], "p3": [10, 100, 50]}
    fig = producer_figures(counts, "p3")
    assert fig["per_producer"]["p0"] == {"prefills": 30, "prefill_share": 0.3, "uncached_tokens": 100,
                                         "cached_share": 0.9}
    assert fig["per_producer"]["p2"]["cached_share"] is None
    assert fig["slow_share_ratio"] == pytest.approx(0.333)
    assert fig["slow_work_ratio"] == pytest.approx(0.5)  # 50 uncached tokens against the fast ones' mean 100
    assert producer_figures(counts, None)["slow_share_ratio"] is None
    assert producer_figures(counts, None)["slow_work_ratio"] is None
    empty = producer_figures({n: [0, 0, 0] for n in counts}, "p3")
    assert empty["slow_share_ratio"] is None and empty["slow_work_ratio"] is None


def _row(
    p50: float, share: float | None = None, cpu: float | None = 100.0, slow: float | None = None,
    work: float | None = None,
) -> dict[str, Any]:
    return {
        "rps": 100.0, "ttfb_ms": {"p50": p50, "p99": 4 * p50}, "router_ttft_ms": {"p50": p50, "p99": None},
        "cached_share": share, "router_cpu_us_per_req": cpu, "errors": {"count": 0},
        "producers": {"per_producer": {"p0": {"prefills": 5}}, "slow_share_ratio": slow, "slow_work_ratio": work},
    }


def _results(**rows: dict[str, Any]) -> dict[str, Any]:
    return {"concurrency": 32, "targets": rows, "unavailable": {}, "variant": {"zipf_s": 0.0, "slow": "p3"}}


def test_the_targets_judge_held_against_the_ideal_the_peer_replicas_and_affinity() -> None:
    res = _results(
        held=_row(30, 0.81, cpu=104, slow=0.85, work=0.5), affinity=_row(40, 0.45, cpu=100, slow=1.0),
        **{"held-2-replicas": _row(31, 0.77), "peer-consistent_hash": _row(45, 0.36, cpu=70),
           "peer-cache_aware": _row(38, 0.5, cpu=70), "ideal": _row(25, 0.89, cpu=None)},
    )
    rows = {t: (f, th, v) for t, f, th, v in variant_targets("prefix_scarce_slow", res)}
    v = "prefix_scarce_slow: "
    assert rows[v + "held cached share ÷ ideal's"] == ("0.910", "≥ 0.9", "PASS")
    assert rows[v + "held TTFB p50 ÷ ideal's"] == ("1.200", "≤ 1.25", "PASS")
    assert rows[v + "held TTFB p50 ÷ peer-cache_aware's (the peer's best)"] == ("0.789", "≤ 0.8", "PASS")
    assert rows[v + "two replicas' cached share − one's (points)"] == ("-4.0", "within ±5", "PASS")
    assert rows[v + "held router CPU/req ÷ affinity's"] == ("1.040", "≤ 1.05", "PASS")
    # Judged by prefill work (uncached tokens); the count of prefills shown beside it.
    assert rows[v + "held: slow producer's prefill work (uncached tokens) ÷ a fast one's"] == (
        "0.500 (prefills 0.850)", "≤ 0.6", "PASS")
    assert rows[v + "held TTFB p50 ÷ affinity's"] == ("0.750", "< 1", "PASS")
    res["targets"]["held-2-replicas"]["cached_share"] = 0.75
    res["targets"]["held"]["router_cpu_us_per_req"] = 106
    verdicts = {t: v for t, _, _, v in variant_targets("prefix_scarce_slow", res)}
    assert verdicts[v + "two replicas' cached share − one's (points)"] == "FAIL"
    assert verdicts[v + "held router CPU/req ÷ affinity's"] == "FAIL"
    res["variant"]["slow"] = None
    assert len(variant_targets("prefix_scarce_uniform", res)) == 5  # the slow producer's two only when there is one


def test_held_rows_not_available_make_their_targets_na_and_show_why() -> None:
    why = 'not available: narwhal: invalid settings: placement: policy "held" is not in this build yet'
    res = _results(affinity=_row(40, 0.45), ideal=_row(25, 0.89, cpu=None))
    res["unavailable"] = {"held": why, "held-2-replicas": why}
    rows = targets({"prefix_scarce_slow": res})
    assert len(rows) == 7 and all(v == "n/a" and f == "— (held not available)" for _, f, _, v in rows)
    text = "\n".join(table({"prefix_scarce_slow": res}))
    assert "## Scarce KV (prefix_scarce)" in text
    assert f"| prefix_scarce_slow (c=32) | held | {why} |" in text
    assert "| prefix_scarce_slow (c=32) | affinity | 100.0 | 40 | 160 | 40 | 0.450 | 100 | p0 5 |" in text
    assert table({}) == []


def test_prefix_scarce_runs_only_when_named_and_names_its_three_variants() -> None:
    named = [*placement_scenarios(True), *scarce_scenarios(True)]
    assert not {s.name for s in select(all_scenarios(quick=True, cores=2), None, named)} & set(VARIANTS)
    chosen = select(all_scenarios(quick=True, cores=2), "prefix_scarce", named)
    assert [s.name for s in chosen] == list(VARIANTS)
    assert all(s.kind == "scarce" and s.concurrency == 32 and s.targets == SCARCE_ROWS for s in chosen)


def test_rows_are_checked_when_parsed() -> None:
    assert parse_args(["--rows", "ideal, affinity"]).rows == ("ideal", "affinity")
    assert parse_args([]).rows is None
    with pytest.raises(SystemExit):
        parse_args(["--rows", "held,nope"])


async def test_requests_alternate_between_replicas() -> None:
    hits: Counter[int] = Counter()

    def app(k: int) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            hits[k] += 1
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n')
            return resp

        a = web.Application()
        a.router.add_post("/v1/chat/completions", chat)
        return a

    runners = [web.AppRunner(app(k)) for k in range(2)]
    urls = []
    for runner in runners:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        users = ChatUsers(system_prompts(2, 256), turns=5, seed=1)
        result = await run_users("two", urls, users, 3, 0.2, 0.05, {})
    finally:
        for runner in runners:
            await runner.cleanup()
    assert result.requests > 0 and not result.errors
    assert abs(hits[0] - hits[1]) <= 1
