"""``prefix_scarce`` offline: the real placement against the fake's KV model, in simulated time.

Why: the timed scenario (``perf/load/scarce.py``) runs on a shared 2-core machine, where a round's
figures move by 10-20 % with the neighbours' load, and one variant takes a minute. A placement
policy is a function of what it reads (holdings, in-flight counts, engine readings), so it can
be judged deterministically: this module drives the router's own :class:`Placement` (policy
``held``, ``affinity``, ``least_loaded``), the supervisor's own :class:`HoldingsModel` (reports
merged every ``LOOP_S``, sections published at most every ``PUBLISH_S``) and the fake engine's
own :class:`PrefixCache` (vLLM's LRU block pool), with ``perf/load/chat``'s users and the
scenario's sizes, on an event queue with an injected clock. It runs a variant in about a second.

What is modelled, and what is not:

* producers as the fake runs them (``narwhal.fake_engine.work``): ``max_num_seqs`` slots in FIFO
  order, one prefill lane (uncached tokens × the per-token cost), blocks in use never evicted;
* the request path as fixed delays (``PathDelays``) standing in for HTTP and CPU, jittered so
  users do not march in step; consumers as a delay (they hold no prefix);
* engine readings (running, waiting, KV usage, this host's legs in them) every ``load_interval_s``,
  and the engine's prefill counters (``vllm:request_prefill_time_seconds``, scheduled to prefill
  done, the lane's wait included, and the prefix cache's queries and hits) into the holdings,
  whose engine-reported rate scales the homes' rooms; each host reads at its own moments;
* not modelled: CPU contention (the real rows' TTFB is mostly that on 2 cores), so the figures
  here are the cached share and the time spent at the producers, not the rows' TTFB.

``python -m perf.scarce_sim [--variant uniform,zipf,slow] [--rows held,affinity,...] [--seeds N]``
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from narwhal.engines.endpoints import BY_PATH
from narwhal.fake_engine.prefix import prompt_text, text_tokens
from narwhal.fleet import Fleet
from narwhal.fleet.placement import LocalInflight, Placement, Reservation
from narwhal.fleet.placement.registry import build
from narwhal.request.affinity import prepared
from narwhal.settings import Settings
from narwhal.shm.holdings import Held, PrefillReport
from narwhal.supervisor.edge import LOOP_S
from narwhal.supervisor.holdings import HoldingsModel
from perf.load.chat import ChatUsers, system_prompts
from perf.load.generator import MODEL as MODEL_NAME
from perf.load.scarce import (
    KV_BLOCKS,
    PREFILL_US_PER_TOKEN,
    PRODUCERS,
    PROMPT_CHARS,
    PROMPTS,
    VARIANTS,
    Variant,
    ideal_assignment,
)
from perf.scarce_producer import Prefill, Producer

CHAT = BY_PATH["/v1/chat/completions"]
CONSUMERS = 2
ROWS = ("held", "affinity", "least_loaded", "held-2-replicas", "ideal")


@dataclass(frozen=True)
class PathDelays:
    """Seconds the real stack spends around the prefill (HTTP, the router, the load generator),
    chosen so a hit's round trip is about the real rows' (~30-40 ms per request at c=32)."""

    to_producer: float = 0.008  # client → router → producer
    back: float = 0.002  # producer's answer → router
    first_token: float = 0.012  # router → consumer → first token at the client
    rest: float = 0.002  # first token → the stream's end, then the user's next request
    jitter: float = 0.5  # each delay × uniform(1 - jitter, 1 + jitter)


class Loop:
    """A discrete-event loop over simulated seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), fn))

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            self.now, _, fn = heapq.heappop(self._queue)
            fn()
        self.now = until


@dataclass
class Reading:
    """An engine reading as the supervisor publishes it (``fleet.placement.load.LoadReading``)."""

    read_at: float
    running: float
    waiting: float
    kv_usage: float | None
    ours: float


class Host:
    """One router host: its workers' placements over one set of fleet-wide counts, its supervisor's holdings."""

    def __init__(self, loop: Loop, settings: Settings, fleet: Fleet, workers: int, seed: int) -> None:
        self.loop = loop
        self.fleet = fleet
        self.inflight = LocalInflight(len(fleet.engines))  # the shared-memory sums: one per host
        self.readings: list[Reading | None] = [None] * len(fleet.engines)
        self.version = 0
        self.published: list[Held | None] = [None] * len(fleet.engines)
        self.work_chars = [0] * len(fleet.engines)
        stamps = [1 if e.can_prefill else None for e in fleet.engines]
        self.model = HoldingsModel(stamps, settings.placement.held.holdings_slots, settings.placement.held.block_chars,
                                   fleet.engines)
        for e in fleet.engines:
            if e.can_prefill:
                self.model.set_capacity(e.index, KV_BLOCKS * 16)
        self.reports: list[PrefillReport] = []
        self.placements = [
            Placement(fleet, _AllAdmitted(), self.inflight, settings.placement, random.Random(seed * 100 + w),
                      loads=self, clock=lambda: loop.now, policy=build(settings.placement, self))
            for w in range(workers)
        ]

    # LoadSource
    def load_version(self) -> int:
        return self.version

    def load_readings(self) -> Sequence[Reading | None]:
        return self.readings

    # HoldingsSource
    def current(self) -> Sequence[Held | None]:
        return self.published

    def work(self) -> Sequence[int]:
        return self.work_chars

    def add_work(self, engine: int, chars: int) -> None:
        self.work_chars[engine] = max(self.work_chars[engine] + chars, 0)

    def report_prefill(
        self, producer: int, engine_id: str | None, prompt_chars: int, prompt_tokens: int | None,
        cached_tokens: int | None, duration_s: float, keys: list[int], queued_chars: int = 0, at: float = 0.0,
    ) -> None:
        """A worker's report, as its ring carries it to the supervisor (every engine one stamp here)."""
        self.reports.append(PrefillReport(producer, 1, 1, prompt_chars, prompt_tokens, cached_tokens, duration_s,
                                          tuple(keys), queued_chars, at))

    # the supervisor's Holdings.publish
    def publish(self, engine: int, stamp: int, engine_id: int, keys: list[int], capacity_blocks: int | None,
                rate: float | None, cpt: float | None, mean: float, hot_blocks: int = 0,
                homes: dict[int, int] | None = None) -> None:
        self.published[engine] = Held(frozenset(keys), len(keys), capacity_blocks, cpt, rate, mean, engine_id,
                                      hot_blocks, homes or None)

    def supervise(self) -> None:
        """One pass of the supervisor's loop: merge the reports in completion order, publish."""
        reports, self.reports = sorted(self.reports, key=lambda r: r.at), []
        for rep in reports:
            self.model.apply(rep)
        self.model.publish(self, self.loop.now)  # type: ignore[arg-type]
        self.loop.at(self.loop.now + LOOP_S, self.supervise)

    def read_loads(self, producers: Sequence[Producer], interval: float) -> None:
        prefills = self.inflight.totals("prefill")
        now = self.loop.now
        for e in self.fleet.engines:
            if e.can_prefill:
                p = producers[e.index]
                self.readings[e.index] = Reading(now, p.running, len(p.waiting), p.kv_usage(), prefills[e.index])
                self.model.engine_read(e.index, KV_BLOCKS * 16, p.counters(), now)
        self.version += 1
        self.loop.at(now + interval, lambda: self.read_loads(producers, interval))


class _AllAdmitted:
    """A FleetView where every engine is admitted."""

    def admitted(self, engine: Any) -> bool:
        return True

    placeable = admitted

    def any_quarantined(self) -> bool:
        return False

    def quarantine_left(self, engine: Any) -> float:
        return 0.0


@dataclass
class Tally:
    """What a row measured over the window."""

    ttft: list[float] = field(default_factory=list)
    requests: int = 0


def _settings(policy: str) -> Settings:
    engines = [{"name": f"p{i}", "url": f"http://127.0.0.1:{9000 + i}", "role": "producer", "models": [MODEL_NAME]}
               for i in range(PRODUCERS)]
    engines += [{"name": f"d{i}", "url": f"http://127.0.0.1:{9100 + i}", "role": "consumer", "models": [MODEL_NAME]}
                for i in range(CONSUMERS)]
    return Settings(engines=engines, placement={"policy": policy})

def _summary(row: str, edges: list[list[tuple[int, int, int]]], tally: Tally, duration_s: float) -> dict[str, Any]:
    """The window's figures: producers' counters at its two edges, and what the users measured."""
    deltas = [tuple(b - a for a, b in zip(x, y, strict=True)) for x, y in zip(edges[0], edges[1], strict=True)]
    queried = sum(d[1] for d in deltas)
    ttft = sorted(tally.ttft)
    return {
        "row": row,
        "cached_share": round(sum(d[2] for d in deltas) / queried, 3) if queried else None,
        "ttft_ms_p50": round(1000 * ttft[len(ttft) // 2], 1) if ttft else None,
        "ttft_ms_p99": round(1000 * ttft[int(len(ttft) * 0.99)], 1) if ttft else None,
        "rps": round(tally.requests / duration_s, 1),
        "prefills": [d[0] for d in deltas],
        "uncached": [d[1] - d[2] for d in deltas],  # prompt tokens each producer computed
    }


def _producers_and_hosts(
    variant: Variant, row: str, seed: int, settings: Settings, loop: Loop,
) -> tuple[list[Producer], list[Host]]:
    """The variant's producers, and one router host (two for ``held-2-replicas``) supervising and reading loads."""
    fleet = Fleet(settings)
    rates = variant.rates()
    producers = [Producer(loop, PREFILL_US_PER_TOKEN * 1e-6 / rates[i]) for i in range(PRODUCERS)]
    hosts = [Host(loop, settings, fleet, 2, seed * 10 + h) for h in range(2 if row == "held-2-replicas" else 1)]
    interval = settings.placement.load_interval_s
    for h, host in enumerate(hosts):
        host.supervise()
        # Each host reads the engines at its own moments (a second replica a third of an interval later).
        loop.at(h * interval / 3, functools.partial(host.read_loads, producers, interval))
    return producers, hosts


def _edges(loop: Loop, producers: Sequence[Producer], window: tuple[float, float]) -> list[list[tuple[int, int, int]]]:
    """Run the loop to the window's two edges; the producers' (prefills, queried, hits) at each."""
    edges = []
    for edge in window:
        loop.run(edge)
        edges.append([(p.prefills, p.queries, p.hits) for p in producers])
    return edges


def _placed(host: Host, rng: random.Random, body: dict[str, Any],
            settings: Settings) -> tuple[Reservation, Host, Placement]:
    """A request placed by one of ``host``'s workers (at random), as the router's admission and
    placement would: its reservation, the host, and the placement (whose policy hears of its prefill)."""
    placement = host.placements[rng.randrange(len(host.placements))]
    _, note = prepared(CHAT, body, settings.placement, placement.policy)
    resv = placement.try_place(MODEL_NAME, frozenset(), note, False)
    assert resv is not None, "no caps in this fleet: a pair is always free"
    return resv, host, placement


def simulate(variant: Variant, row: str, seed: int = 0, warmup_s: float = 1.0, duration_s: float = 3.0,
             concurrency: int = 32, delays: PathDelays = PathDelays()) -> dict[str, Any]:
    """One row of one variant from cold caches: cached share, producer time p50/p99 (ms), prefills per producer."""
    loop = Loop()
    policy = "held" if row == "held-2-replicas" else row if row != "ideal" else "held"
    settings = _settings(policy)
    producers, hosts = _producers_and_hosts(variant, row, seed, settings, loop)
    rates = variant.rates()
    rng = random.Random(seed)
    source = ChatUsers(system_prompts(PROMPTS, PROMPT_CHARS), turns=5, seed=seed, weights=variant.weights(),
                       multi_turn=0.3)
    assignment = ideal_assignment(variant.weights(), rates)
    tally = Tally()
    counter = itertools.count()
    window = (warmup_s, warmup_s + duration_s)

    def jitter(d: float) -> float:
        return d * rng.uniform(1 - delays.jitter, 1 + delays.jitter)

    def user(u: int) -> None:
        body = source.data(u)
        sent = loop.now
        text = prompt_text(body, chat=True)
        tokens = text_tokens(text)
        n = next(counter)
        if row == "ideal":
            index, resv, host, placement = assignment[source.system_of(u)], None, hosts[0], None
        else:
            resv, host, placement = _placed(hosts[n % len(hosts)], rng, body, settings)
            index = resv.producer.index
        p = producers[index]

        def prefilled(cached: int) -> None:
            def answered() -> None:
                now = loop.now
                if resv is not None and placement is not None:
                    resv.release_prefill()
                    if resv.note is not None:  # as the router's attempt does: the policy reports it
                        placement.policy.prefilled(resv, SimpleNamespace(
                            descriptor=None, prompt_tokens=tokens, cached_tokens=cached,
                            started_at=placed_at, finished_at=now))
                if window[0] <= sent and now <= window[1] + 1.0 and sent < window[1]:
                    tally.ttft.append(now - sent)
                    tally.requests += 1
                loop.at(now + jitter(delays.first_token) + jitter(delays.rest), finished)
            loop.at(loop.now + jitter(delays.back), answered)

        def finished() -> None:
            if resv is not None:
                resv.release()
            user(u)

        placed_at = loop.now
        loop.at(loop.now + jitter(delays.to_producer), lambda: p.submit(Prefill(p.cache.block_hashes(text), tokens,
                                                                                 prefilled)))

    for u in range(concurrency):
        loop.at(rng.uniform(0, 0.01), lambda u=u: user(u))
    return _summary(row, _edges(loop, producers, window), tally, duration_s)


def _slow_share(per_producer: Sequence[int]) -> float:
    """The slow producer's (the last) figure ÷ the fast ones' mean."""
    fast = per_producer[:-1]
    return per_producer[-1] / (sum(fast) / len(fast)) if sum(fast) else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.scarce_sim", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="uniform,zipf,slow")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0)
    args = parser.parse_args(argv)
    for v in args.variant.split(","):
        variant = VARIANTS[f"prefix_scarce_{v}"]
        for row in args.rows.split(","):
            runs = [simulate(variant, row, seed, duration_s=args.duration) for seed in range(args.seeds)]
            share = [r["cached_share"] for r in runs]
            p50 = [r["ttft_ms_p50"] for r in runs]
            p99 = [r["ttft_ms_p99"] for r in runs]
            prefills = [sum(r["prefills"][i] for r in runs) for i in range(PRODUCERS)]
            uncached = [sum(r["uncached"][i] for r in runs) for i in range(PRODUCERS)]
            ratio = ""
            if variant.slow:
                ratio = f" slow/fast {_slow_share(prefills):.2f} (uncached tokens {_slow_share(uncached):.2f})"
            print(f"{v:8} {row:16} cached {min(share):.3f}-{max(share):.3f} ttft p50 {min(p50)}-{max(p50)} ms "
                  f"p99 {min(p99)}-{max(p99)} rps {sum(r['rps'] for r in runs) / len(runs):.0f} "
                  f"prefills {prefills}{ratio}")


if __name__ == "__main__":
    main()
