"""``prefix_scarce``: placement when each producer's KV holds only 2–3 of the shared prompts.

Why its own module beside ``perf/load/placement.py``: the rows here are not variants of one router but
different placements of the same load, some of which are no Narwhal router at all: the three
``placement.policy`` values, two replicas with requests alternating between them, the peer's two
prefill policies, and an *ideal* row where the load generator does P/D itself with a perfect
static prompt → producer assignment (``ideal_assignment``), the figure the others are judged
against. The fleets, the peer command, the cold caches between rounds, the tally and the
figures are ``perf/load/placement``'s; the load loop is ``perf/load/chat``'s.

Rows that use ``policy = "held"`` are tried and, when the router refuses that setting at start
(a build without the holdings table), reported "not available" with the router's one line,
while the other rows run.

Per row beside the placement figures: every producer's prefills, uncached prompt tokens, cached
share and prefill share over the measured windows (its stats' counters at the window's edges), and
in the slow variant the slow producer's prefills and its uncached tokens (its prefill work, what
the target is judged by: perf/README.md "Scarce KV") each ÷ a fast one's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.load.chat import AccessLog, ChatUsers, run_users, system_prompts, zipf_weights
from perf.load.generator import CHAT, PREFILL_KV, PdLegs, RoundResult
from perf.load.placement import Running, Tally, cold_caches, figures, start_peers
from perf.load.scenarios import Scenario
from perf.load.stack import Target, router_sections
from perf.report.scarce import variant_targets

PRODUCERS = 4
CONSUMERS = 2
PROMPTS = 2 * PRODUCERS
PROMPT_CHARS = 4000
# A 4,000-character prompt is 62 full KV blocks of 16 tokens (64 characters): 160 blocks hold 2.5.
KV_BLOCKS = 160
MAX_NUM_SEQS = 4
PREFILL_US_PER_TOKEN = 20
ZIPF_S = 1.1
MULTI_TURN = 0.3  # share of chats that are multi-turn, of 2..MAX_TURNS turns
MAX_TURNS = 5
SLOW = "p3"  # the producer at half the prefill rate in the slow variant
HELD = "held"
REPLICAS = "held-2-replicas"
IDEAL = "ideal"
POLICIES = ("held", "affinity", "least_loaded")  # the rows that are one Narwhal router each


@dataclass(frozen=True, slots=True)
class Variant:
    """One fleet and load of the scenario: prompt popularity, and whether one producer is slow."""

    zipf_s: float  # 0: uniform
    slow: bool

    def weights(self) -> list[float]:
        return zipf_weights(PROMPTS, self.zipf_s)

    def rates(self) -> list[float]:
        """Each producer's prefill rate relative to the others'."""
        return [0.5 if self.slow and f"p{i}" == SLOW else 1.0 for i in range(PRODUCERS)]

    def producer_args(self) -> list[str]:
        args = [
            "--tokens", "16", "--prefix-cache", "--kv-blocks", str(KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--prefill-us-per-token", str(PREFILL_US_PER_TOKEN),
        ]
        if self.slow:
            args += ["--prefill-us-per-token", f"{SLOW}={2 * PREFILL_US_PER_TOKEN}"]
        return args


VARIANTS = {
    "prefix_scarce_uniform": Variant(0.0, False),
    "prefix_scarce_zipf": Variant(ZIPF_S, False),
    "prefix_scarce_slow": Variant(0.0, True),
}


def ideal_assignment(weights: Sequence[float], rates: Sequence[float]) -> list[int]:
    """Prompt → producer: the most popular first, each to the producer whose share of the traffic
    ÷ its rate would then be least (ties: fewer prompts, then the lower index), at most
    ⌈prompts ÷ producers⌉ prompts each: here 2 of the 2.5 a producer's KV holds, so none evicts its own."""
    cap = -(-len(weights) // len(rates))
    load = [0.0] * len(rates)
    count = [0] * len(rates)
    out = [0] * len(weights)
    for p in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        room = [j for j in range(len(rates)) if count[j] < cap]
        best = min(room, key=lambda j: ((load[j] + weights[p]) / rates[j], count[j], j))
        load[best] += weights[p]
        count[best] += 1
        out[p] = best
    return out


class IdealLegs:
    """The ideal row's requests: the prefill to the prompt's assigned producer, the decode to the
    user's consumer (users split evenly), both sent by the load generator as ``direct-pd`` does."""

    def __init__(self, source: ChatUsers, producers: list[str], consumers: list[str], assignment: list[int]) -> None:
        self.source = source
        self.producers = [u + CHAT for u in producers]
        self.consumers = [u + CHAT for u in consumers]
        self.assignment = assignment

    def __call__(self, user: int) -> tuple[str, PdLegs]:
        data = self.source.data(user)
        prefill = {**data, "stream": False, "max_tokens": 1, "ignore_eos": True, "kv_transfer_params": PREFILL_KV}
        producer = self.producers[self.assignment[self.source.system_of(user)]]
        return self.consumers[user % len(self.consumers)], PdLegs(producer, orjson.dumps(prefill), data)


@dataclass(slots=True)
class ScarceTally(Tally):
    """``perf/load/placement``'s tally, plus each producer's counters over the measured windows."""

    producers: dict[str, list[int]] = field(default_factory=dict)  # name -> [prefills, queried, cached]


@dataclass(slots=True)
class _Scarce:
    run: Running
    variant: Variant
    unavailable: dict[str, str] = field(default_factory=dict)  # row -> why it did not run
    urls: dict[str, list[str]] = field(default_factory=dict)  # router rows: where requests go


def _refusal(log_path: Path, exc: Exception) -> str:
    """The router's own last line (its one-line start-up error), else what the harness saw."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else f"{type(exc).__name__}: {exc}"


def _router(s: _Scarce, name: str, key: str, policy: str, out_dir: Path, workers: int) -> RouterProcess | str:
    """One Narwhal router with ``policy``, its access log kept under ``key``; why not, if it did not start."""
    run = s.run
    engines = [{"name": n, "url": u, "role": "producer"} for n, u in run.producers.engines.items()]
    engines += [{"name": n, "url": u, "role": "consumer"} for n, u in run.consumers.engines.items()]
    log = out_dir / f"access-{name}-{key}.log"
    sections = router_sections(workers, str(log))
    sections["placement"] = {**sections["placement"], "policy": policy}
    config = write_config(engines, sections)
    run.configs.append(config)
    log_path = out_dir / f"router-{name}-{key}.log"
    try:
        router = RouterProcess.start(config, log_path=str(log_path), timeout=60, workers=workers)
    except (RuntimeError, TimeoutError) as exc:
        if policy != HELD:
            raise
        return _refusal(log_path, exc)
    run.routers.append(router)
    run.logs[key] = AccessLog(log)
    return router


def _start_routers(s: _Scarce, name: str, rows: Sequence[str], out_dir: Path, workers: int) -> None:
    """The Narwhal rows: one router per policy, two for the replicas; a refused ``held`` marks
    every held row not available (the replicas are not tried again)."""
    for row in rows:
        if row not in (*POLICIES, REPLICAS) or row in s.unavailable:
            continue
        policy = HELD if row == REPLICAS else row
        started: list[RouterProcess] = []
        for k in range(2 if row == REPLICAS else 1):
            router = _router(s, name, row if k == 0 else f"{row}#{k + 1}", policy, out_dir, workers)
            if isinstance(router, str):
                for r in (HELD, REPLICAS) if row == HELD else (row,):
                    if r in rows:
                        s.unavailable[r] = f"not available: {router}"
                break
            started.append(router)
        else:
            alive = (lambda procs=tuple(r.proc for r in started): all(p.poll() is None for p in procs))  # noqa: E731
            s.run.targets[row] = Target(row, "narwhal", started[0].url, [r.proc.pid for r in started], alive,
                                        {"policy": policy, "replicas": len(started)})
            s.urls[row] = [r.url for r in started]


def start(name: str, rows: Sequence[str], out_dir: Path, workers: int, peer: str | None) -> _Scarce:
    """The variant's fleets, then every requested row that can run (the ideal needs no process)."""
    variant = VARIANTS[name]
    producers = [f"p{i}" for i in range(PRODUCERS)]
    run = Running(
        FakeFleet.start(producers, args=variant.producer_args()),
        FakeFleet.start([f"d{i}" for i in range(CONSUMERS)], args=["--tokens", "16"]),
    )
    s = _Scarce(run, variant)
    try:
        _start_routers(s, name, rows, out_dir, workers)
        policies = tuple(r.removeprefix("peer-") for r in rows if r.startswith("peer-"))
        if peer is not None and policies:
            start_peers(run, name, peer, out_dir, policies)
        if IDEAL in rows:
            consumer = next(iter(run.consumers.engines.values()))
            alive = (lambda: run.producers.proc.poll() is None and run.consumers.proc.poll() is None)  # noqa: E731
            run.targets[IDEAL] = Target(IDEAL, "direct", consumer, [], alive)
    except BaseException:
        run.close()
        raise
    return s


def _counters(fleet: FakeFleet) -> dict[str, tuple[int, int, int]]:
    """Per producer: (prefills, queried, cached) prompt tokens so far, from its stats."""
    stats = fleet.control_request("GET", "/engines")
    return {
        n: (st["requests"]["prefill"], st["prefix_cache"]["queries"], st["prefix_cache"]["hits"])
        for n, st in stats.items()
    }


def _source(variant: Variant, seed: int) -> ChatUsers:
    return ChatUsers(
        system_prompts(PROMPTS, PROMPT_CHARS), turns=MAX_TURNS, seed=seed, weights=variant.weights(),
        multi_turn=MULTI_TURN,
    )


async def _one_round(
    s: _Scarce, row: str, scenario: Scenario, duration_s: float, r: int
) -> tuple[RoundResult, list[dict[str, Any]], dict[str, list[int]]]:
    run = s.run
    await asyncio.to_thread(cold_caches, run.producers)
    edges: list[dict[str, tuple[int, int, int]]] = []

    async def read_counters() -> None:
        edges.append(await asyncio.to_thread(_counters, run.producers))

    logs = [log for key, log in run.logs.items() if key == row or key.startswith(row + "#")]
    for log in logs:
        log.mark()
    source = _source(s.variant, r)
    legs = None
    if row == IDEAL:
        assignment = ideal_assignment(s.variant.weights(), s.variant.rates())
        legs = IdealLegs(source, list(run.producers.engines.values()), list(run.consumers.engines.values()),
                         assignment)
    result = await run_users(
        row, s.urls.get(row, [run.targets[row].url]), source, scenario.concurrency, duration_s, scenario.warmup_s,
        run.groups(), on_edge=read_counters, legs=legs,
    )
    records = [rec for log in logs for rec in log.since_mark()]
    opened, closed = edges
    return result, records, {n: [b - a for a, b in zip(opened[n], closed[n], strict=True)] for n in closed}


async def measure(s: _Scarce, scenario: Scenario, rounds: int, duration_s: float) -> dict[str, ScarceTally]:
    """Every row once per round, in rotating order; what each measured, pooled."""
    names = list(s.run.targets)
    tallies = {n: ScarceTally() for n in names}
    for r in range(rounds):
        k = r % len(names)
        for row in names[k:] + names[:k]:
            result, records, producers = await _one_round(s, row, scenario, duration_s, r)
            tally = tallies[row]
            tally.add(result, records, sum(p[1] for p in producers.values()), sum(p[2] for p in producers.values()))
            for name, delta in producers.items():
                kept = tally.producers.setdefault(name, [0, 0, 0])
                tally.producers[name] = [x + d for x, d in zip(kept, delta, strict=True)]
    return tallies


def producer_figures(counts: dict[str, list[int]], slow: str | None) -> dict[str, Any]:
    """Prefills, prefill share, uncached prompt tokens and cached share per producer; with ``slow``,
    its prefills and its uncached tokens (its prefill work) each ÷ the fast ones' mean."""
    total = sum(c[0] for c in counts.values())
    per = {
        n: {
            "prefills": c[0],
            "prefill_share": round(c[0] / total, 3) if total else None,
            "uncached_tokens": c[1] - c[2],
            "cached_share": round(c[2] / c[1], 3) if c[1] else None,
        }
        for n, c in sorted(counts.items())
    }
    out: dict[str, Any] = {"per_producer": per, "slow_share_ratio": None, "slow_work_ratio": None}
    if slow in counts:
        out["slow_share_ratio"] = _slow_ratio([c[0] for n, c in counts.items() if n != slow], counts[slow][0])
        out["slow_work_ratio"] = _slow_ratio([c[1] - c[2] for n, c in counts.items() if n != slow],
                                             counts[slow][1] - counts[slow][2])
    return out


def _slow_ratio(fast: list[int], slow: int) -> float | None:
    """The slow producer's figure ÷ the fast ones' mean (None without fast ones or with their sum 0)."""
    return round(slow / (sum(fast) / len(fast)), 3) if fast and sum(fast) else None


def run_scarce(
    runner: asyncio.Runner, scenario: Scenario, *, rounds: int, duration_s: float, out_dir: Path, workers: int,
    cores: int, peer: str | None, rows: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Start the variant's processes, measure every row that runs, stop them; figures per row, the
    rows that could not run (``unavailable``: row -> why) and the targets judged (``verdicts``)."""
    wanted = [r for r in scenario.targets if rows is None or r in rows]
    s = start(scenario.name, wanted, out_dir, workers, peer)
    try:
        tallies = runner.run(measure(s, scenario, rounds, duration_s))
    finally:
        s.run.close()
    slow = SLOW if s.variant.slow else None
    stats: dict[str, Any] = {}
    for name, tally in tallies.items():
        stats[name] = figures(s.run.targets[name], tally, cores)
        stats[name]["producers"] = producer_figures(tally.producers, slow)
    variant = {"zipf_s": s.variant.zipf_s, "slow": slow}
    out: dict[str, Any] = {"targets": stats, "unavailable": s.unavailable, "variant": variant}
    out["verdicts"] = [
        {"target": t, "figure": f, "threshold": th, "result": v} for t, f, th, v in variant_targets(scenario.name, out)
    ]
    return out
