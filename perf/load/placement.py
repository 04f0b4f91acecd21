"""The placement scenarios (docs/behaviour.md "Placement"): each its own fleet and routers, variants interleaved by
round.

Why their own processes: placement is judged on what the engines model (prefix cache, prefill
cost, batch limit, background load; docs/behaviour.md "Fake engines"), which the router-cost scenarios must not have on,
and on router settings that differ per variant (affinity on/off, engine-reported load on/off,
local decode on/off). So every scenario starts its fleets with the models it needs and one
router per variant, runs the variants in rotating order every round (as ``perf/load/scenarios`` does),
and stops them all before the next scenario.

Between rounds the producers' prefix caches are emptied (the model is switched off and on
through the control server), so no variant inherits another's warm cache, and every round starts
fresh conversations. The figures per variant: the pooled ``perf.report.summary`` figures (client-felt
TTFB = ``first_byte_s``, router CPU per request), the router's own ``ttft_s`` from its access log,
and the producers' cached share of prompt tokens from their prefix-cache counters (vLLM's
``prefix_cache_queries`` / ``hits``), read as the measured window opens and closes: the steady
state after the warm-up, not the cold start every round begins with.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.load.chat import AccessLog, ChatUsers, FixedBody, run_users, system_prompts
from perf.load.generator import COMPLETIONS, RoundResult, Workload, percentile
from perf.load.scenarios import Scenario
from perf.load.stack import Peer, Target, router_sections
from perf.report.summary import summarize

SHORT = Workload(COMPLETIONS, stream=True, tokens=16)


@dataclass(frozen=True, slots=True)
class Setup:
    """One placement scenario's fleet, routers and load."""

    producers: int
    consumers: int
    producer_args: tuple[str, ...]
    consumer_args: tuple[str, ...]
    variants: dict[str, dict[str, object]]  # variant -> the router's [placement] overrides
    background: dict[str, tuple[int, float]] = field(default_factory=dict)  # consumer -> (N, hold_s)
    chat: bool = False  # multi-turn chats under shared system prompts, else SHORT's fixed body


def setup(name: str, quick: bool) -> Setup:
    """The fleets and variants of each placement scenario (sizes in the README's performance section)."""
    if name == "prefix_mix":
        # 16 system prompts of 4 KiB (64 blocks each, 1,024 in all) against 640 blocks per
        # producer: one producer holds 10 of them, four producers with affinity hold them all.
        # The KV pool is also what running requests use (as in vLLM): with 400 blocks, a producer
        # running its six hashed prompts at once was at kv_saturated and every choice became
        # "saturated"; a GPU's pool is many times a prompt. 100 µs a prompt token (10k tokens/s
        # per producer) makes the fleet prefill-bound, as affinity assumes.
        model = ("--prefix-cache", "--kv-blocks", "640", "--prefill-s-per-token", "0.0001")
        return Setup(
            4, 2, model, (),
            {"held": {"policy": "held"}, "affinity": {"policy": "affinity"},
             "no-affinity": {"policy": "least_loaded"}},
            chat=True,
        )
    if name == "busy_elsewhere":
        batch = ("--max-num-seqs", "8")
        return Setup(
            1, 2, (), batch, {"load-on": {"load_interval_s": 0.1}, "load-off": {"load_interval_s": 0}},
            background={"d1": (16, 0.5)},
        )
    if name == "local_short":
        return Setup(
            1, 1, (), (), {"local": {"local_prefill_chars": 1024}, "disaggregated": {"local_prefill_chars": 0}}
        )
    raise ValueError(f"not a placement scenario: {name}")


@dataclass(slots=True)
class Running:
    """The processes of one scenario: fleets, one router per variant, their access logs."""

    producers: FakeFleet
    consumers: FakeFleet
    targets: dict[str, Target] = field(default_factory=dict)
    routers: list[RouterProcess] = field(default_factory=list)
    peers: list[Peer] = field(default_factory=list)
    logs: dict[str, AccessLog] = field(default_factory=dict)
    configs: list[str] = field(default_factory=list)

    def groups(self) -> dict[str, list[int]]:
        out = {"producer": [self.producers.proc.pid], "consumer": [self.consumers.proc.pid]}
        out.update({name: t.pids for name, t in self.targets.items()})
        return out

    def close(self) -> None:
        for router in self.routers:
            with contextlib.suppress(Exception):
                router.stop(timeout=10)
        for peer in self.peers:
            with contextlib.suppress(Exception):
                peer.stop()
        for fleet in (self.producers, self.consumers):
            with contextlib.suppress(Exception):
                fleet.stop()
        for path in self.configs:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _start(name: str, spec: Setup, out_dir: Path, workers: int, peer: str | None) -> Running:
    producers = [f"p{i}" for i in range(spec.producers)]
    consumers = [f"d{i}" for i in range(spec.consumers)]
    run = Running(
        FakeFleet.start(producers, args=["--tokens", "16", *spec.producer_args]),
        FakeFleet.start(consumers, args=["--tokens", "16", *spec.consumer_args]),
    )
    try:
        engines = [{"name": n, "url": run.producers.engines[n], "role": "producer"} for n in producers]
        engines += [{"name": n, "url": run.consumers.engines[n], "role": "consumer"} for n in consumers]
        for variant, overrides in spec.variants.items():
            log = out_dir / f"access-{name}-{variant}.log"
            sections = router_sections(workers, str(log))
            sections["placement"] = {**sections["placement"], **overrides}
            config = write_config(engines, sections)
            run.configs.append(config)
            router = RouterProcess.start(
                config, log_path=str(out_dir / f"router-{name}-{variant}.log"), timeout=60, workers=workers
            )
            run.routers.append(router)
            alive = (lambda proc=router.proc: proc.poll() is None)  # noqa: E731 - bound per router
            run.targets[variant] = Target(variant, "narwhal", router.url, [router.proc.pid], alive)
            run.logs[variant] = AccessLog(log)
        if peer is not None:
            start_peers(run, name, peer, out_dir)
        for consumer, (count, hold_s) in spec.background.items():
            run.consumers.set_background(consumer, count, hold_s)
    except BaseException:
        run.close()
        raise
    return run


# vllm-router's PD mode over every engine; its prefill policies that aim at the prefix cache are
# cache_aware (approximate radix tree of what it sent where) and consistent_hash.
PEER_MULTI = (
    "vllm-router --vllm-pd-disaggregation {prefills} {decodes} --host 127.0.0.1 --port {port} "
    "--prefill-policy {policy} --decode-policy power_of_two --prometheus-port {free_port}"
)
PEER_POLICIES = ("cache_aware", "consistent_hash")


def start_peers(
    run: Running, name: str, template: str, out_dir: Path, policies: tuple[str, ...] = PEER_POLICIES
) -> None:
    """``--peer vllm-router`` beside the variants, once per prefill policy (the report takes the
    best); another peer command cannot address six engines, so it is not run here."""
    if template.strip() != "vllm-router":
        return
    prefills = " ".join(f"--prefill {u}" for u in run.producers.engines.values())
    decodes = " ".join(f"--decode {u}" for u in run.consumers.engines.values())
    for policy in policies:
        command = PEER_MULTI.replace("{prefills}", prefills).replace("{decodes}", decodes)
        peer = Peer(command.replace("{policy}", policy), "", "", out_dir / f"peer-{name}-{policy}.log")
        run.peers.append(peer)
        peer.wait_serving()
        label = f"peer-{policy}"
        run.targets[label] = Target(label, "peer", peer.url, [peer.proc.pid], peer.alive, {"command": peer.command})


def _producer_cache(fleet: FakeFleet) -> tuple[int, int]:
    """(queried, cached) prompt tokens over every producer of the fleet, from its stats."""
    stats = fleet.control_request("GET", "/engines")
    queries = sum(s["prefix_cache"]["queries"] for s in stats.values())
    return queries, sum(s["prefix_cache"]["hits"] for s in stats.values())


def cold_caches(fleet: FakeFleet) -> None:
    """Empty every producer's prefix cache (off and on again), so no variant inherits a warm one."""
    for name in fleet.engines:
        model = fleet.stats(name)["model"]
        if model["prefix_cache"]:
            fleet.set_model(name, prefix_cache=False)
            fleet.set_model(name, prefix_cache=True)


@dataclass(slots=True)
class Tally:
    rounds: list[RoundResult] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    first_byte: list[float] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)
    queried: int = 0
    cached: int = 0

    def add(self, result: RoundResult, records: list[dict[str, Any]], queried: int, cached: int) -> None:
        """One round: its load figures, its access-log records, the producers' counter deltas."""
        self.rounds.append(result)
        self.queried += queried
        self.cached += cached
        for rec in records:
            if isinstance(rec.get("ttft_s"), int | float):
                self.ttft.append(float(rec["ttft_s"]))
            if isinstance(rec.get("first_byte_s"), int | float):
                self.first_byte.append(float(rec["first_byte_s"]))
            mode = str(rec.get("mode"))
            self.modes[mode] = self.modes.get(mode, 0) + 1


def _source(spec: Setup, seed: int) -> ChatUsers | FixedBody:
    if spec.chat:
        return ChatUsers(system_prompts(16, 4096), turns=6, seed=seed)
    return FixedBody(SHORT.endpoint, SHORT.body())


async def _one_round(
    run: Running, spec: Setup, variant: str, scenario: Scenario, duration_s: float, quick: bool, r: int
) -> tuple[RoundResult, list[dict[str, Any]], tuple[int, int]]:
    target = run.targets[variant]
    await asyncio.to_thread(cold_caches, run.producers)
    edges: list[tuple[int, int]] = []  # the producers' counters as the measured window opens, closes

    async def read_counters() -> None:
        edges.append(await asyncio.to_thread(_producer_cache, run.producers))

    log = run.logs.get(variant)
    if log is not None:
        log.mark()
    result = await run_users(
        variant, target.url, _source(spec, r), scenario.concurrency, duration_s, scenario.warmup_s,
        run.groups(), on_edge=read_counters,
    )
    records = log.since_mark() if log is not None else []
    (q0, c0), (q1, c1) = edges
    return result, records, (q1 - q0, c1 - c0)


async def measure(
    run: Running, spec: Setup, scenario: Scenario, rounds: int, duration_s: float, quick: bool
) -> dict[str, Tally]:
    """Every variant once per round, in rotating order; what each measured, pooled."""
    names = list(run.targets)
    tallies = {n: Tally() for n in names}
    for r in range(rounds):
        k = r % len(names)
        for variant in names[k:] + names[:k]:
            result, records, (queried, cached) = await _one_round(run, spec, variant, scenario, duration_s, quick, r)
            tallies[variant].add(result, records, queried, cached)
    return tallies


def _ms(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000.0, 3)


def figures(target: Target, tally: Tally, cores: int) -> dict[str, Any]:
    """``perf.report.summary``'s figures plus the placement ones: router TTFT, cached share, modes."""
    stats = summarize(target, tally.rounds, cores)
    stats["router_ttft_ms"] = {"p50": _ms(tally.ttft, 50), "p99": _ms(tally.ttft, 99)}
    stats["router_first_byte_ms"] = {"p50": _ms(tally.first_byte, 50), "p99": _ms(tally.first_byte, 99)}
    stats["cached_share"] = round(tally.cached / tally.queried, 3) if tally.queried else None
    stats["prompt_tokens"] = tally.queried
    stats["modes"] = dict(sorted(tally.modes.items()))
    return stats


def run_placement(
    runner: asyncio.Runner,
    scenario: Scenario,
    *,
    rounds: int,
    duration_s: float,
    quick: bool,
    out_dir: Path,
    workers: int,
    cores: int,
    peer: str | None,
) -> dict[str, dict[str, Any]]:
    """Start the scenario's processes, measure every variant, stop them; the figures per target."""
    spec = setup(scenario.name, quick)
    run = _start(scenario.name, spec, out_dir, workers, peer if spec.chat else None)
    try:
        tallies = runner.run(measure(run, spec, scenario, rounds, duration_s, quick))
    finally:
        run.close()
    return {name: figures(run.targets[name], tally, cores) for name, tally in tallies.items()}
