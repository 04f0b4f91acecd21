"""The scenarios of the issue, and how one is run: targets interleaved in short rounds, then pooled.

Why interleaving: the host is shared and noisy (other engineers' test runs, CI). A router
figure measured a minute after its direct baseline would mostly measure the minute; rotating
the order of targets every round and pooling the rounds makes every ratio come from the same
stretch of time. The host's busy CPU not accounted to our processes is reported per scenario
("other CPU %") so a noisy run can be recognised. The pooling itself is ``perf/report/summary.py``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from narwhal.sizing import default_counts
from perf.load.generator import CHAT, COMPLETIONS, RoundResult, Workload, new_session, run_round
from perf.load.pd_endpoints import MESSAGES, RESPONSES
from perf.load.stack import Stack, Target
from perf.profile import Profiler
from perf.profile import summarize as summarize_profile

PACED_FAULT = {"decode": {"token_delay_s": 0.01}}
TARGETS = ("narwhal", "baseline", "direct", "direct-pd", "peer")
# The aiohttp floor (perf/load/floor_proxy.py) beside them: what of Narwhal's figures is the framework's.
WITH_FLOOR = (*TARGETS, "aiohttp-floor")
STREAM = Workload(COMPLETIONS, stream=True, tokens=16)
PACED = Workload(COMPLETIONS, stream=True, tokens=16, fault=PACED_FAULT)
# A longer answer at a slower pace: 128 tokens 20 ms apart, 2.56 s an answer.
PACED_LONG = Workload(COMPLETIONS, stream=True, tokens=128, fault={"decode": {"token_delay_s": 0.02}})
LONG_SYSTEM_CHARS = 4000


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    kind: str = "load"  # "load", "sweep" or "memory"
    workload: Workload = Workload()
    concurrency: int = 32
    targets: tuple[str, ...] = TARGETS
    warmup_s: float = 0.4
    workers: tuple[int, ...] = ()  # the sweep's worker counts
    streams: int = 0  # memory: slow streams held open at once
    expects_errors: bool = False


def sweep_workers(cores: int) -> tuple[int, ...]:
    """1, 2, 4 … up to 2 × cores: the counts ``narwhal workers`` tries (``narwhal.sizing``)."""
    return tuple(default_counts(cores))


def all_scenarios(quick: bool, cores: int | None = None) -> list[Scenario]:
    """Every scenario, full size or ``--quick`` size (same names, smaller counts)."""
    cores = cores or os.cpu_count() or 1
    big = 200 if quick else 1000
    scenarios = [*_load_scenarios(quick, big), *_endpoint_scenarios(), _sweep_scenario(cores, quick),
                 _memory_scenario(big)]
    if quick:
        # Paced streams last 160 ms and more: a 0.2 s warm-up on a loaded host can leave the
        # 0.5 s window with none finished yet (seen as a CI-style smoke failure, 0 requests).
        scenarios = [
            replace(s, warmup_s=0.5 if s.concurrency > 128 or s.workload.fault is not None else 0.2)
            for s in scenarios
        ]
    return scenarios


def _load_scenarios(quick: bool, big: int) -> list[Scenario]:
    """The closed-loop scenarios at one concurrency each, Narwhal next to the baselines."""
    return [
        Scenario(
            "stream_c1", "streaming completions, 16 tokens, c=1", workload=STREAM, concurrency=1,
            targets=WITH_FLOOR,
        ),
        Scenario(
            "stream_c32", "streaming completions, 16 tokens, c=32", workload=STREAM, concurrency=32,
            targets=WITH_FLOOR,
        ),
        Scenario("stream_c128", "streaming completions, 16 tokens, c=128", workload=STREAM, concurrency=128),
        Scenario("paced_c128", "paced decode 10 ms/token, 16 tokens, c=128", workload=PACED, concurrency=128),
        # Full runs only: --quick's smoke run meets no path here that paced_c128 and paced_c1000 do not.
        *([] if quick else [Scenario("paced_c512", "paced decode 10 ms/token, 16 tokens, c=512", workload=PACED,
                                     concurrency=512, warmup_s=1.0)]),
        # --quick: 16 tokens (0.32 s an answer), so the smoke run does not wait on 2.56 s answers.
        Scenario("paced_long_c128", "paced decode 20 ms/token, 128 tokens, c=128",
                 workload=replace(PACED_LONG, tokens=16) if quick else PACED_LONG,
                 concurrency=128, warmup_s=0.7 if quick else 3.0),
        Scenario(
            "paced_c1000",
            f"paced decode 10 ms/token, 16 tokens, c={big}",
            workload=PACED,
            concurrency=big,
            warmup_s=0.8 if quick else 1.5,
        ),
    ]


def _endpoint_scenarios() -> list[Scenario]:
    """The other request shapes at c=32: non-streaming, chat (short and long prompts), the other P/D endpoints."""
    return [
        Scenario(
            "nonstream_c32",
            "non-streaming completions, 16 tokens, c=32",
            workload=Workload(COMPLETIONS, stream=False, tokens=16),
            concurrency=32,
            targets=WITH_FLOOR,
        ),
        Scenario(
            "chat_c32",
            "streaming chat completions, 16 tokens, c=32",
            workload=Workload(CHAT, stream=True, tokens=16),
            concurrency=32,
        ),
        # The same with a 4,000-character system prompt: what a long prompt costs over chat_c32.
        Scenario(
            "chat_long",
            "streaming chat completions, 4,000-character system prompt, 16 tokens, c=32",
            workload=Workload(CHAT, stream=True, tokens=16, system_chars=LONG_SYSTEM_CHARS),
            concurrency=32,
        ),
        # The other P/D endpoints against the same fleet; the direct-pd floor speaks completions only.
        *(
            Scenario(f"{name}_c32", f"streaming {title}, 16 tokens, c=32", concurrency=32,
                     workload=Workload(endpoint, stream=True, tokens=16), targets=("narwhal", "direct"))
            for name, title, endpoint in (("responses", "Responses API", RESPONSES),
                                          ("messages", "Anthropic Messages", MESSAGES))
        ),
        Scenario(
            "accesslog_c32",
            "streaming, c=32: access log to a file vs none",
            workload=STREAM,
            concurrency=32,
            targets=("narwhal", "narwhal+log", "direct"),
        ),
    ]


def _sweep_scenario(cores: int, quick: bool) -> Scenario:
    """One router per worker count, all up at once and interleaved like any other targets."""
    sweep = sweep_workers(cores)
    if quick:
        sweep = sweep[:2]
    return Scenario(
        "workers",
        "worker sweep: streaming, 16 tokens, c=128",
        kind="sweep",
        workload=STREAM,
        concurrency=128,
        workers=sweep,
        targets=(*(f"narwhal-w{n}" for n in sweep), "direct"),
    )


def _memory_scenario(big: int) -> Scenario:
    return Scenario(
        "memory",
        f"memory: {big} open slow streams",
        kind="memory",
        concurrency=big,
        streams=big,
        targets=("narwhal-mem", "peer-mem"),  # fresh processes: earlier load would set the baseline
    )


def placement_scenarios(quick: bool) -> list[Scenario]:
    """docs/behaviour.md "Placement"'s scenarios (``perf/load/placement.py``): run when named, each with its own
    fleets.
    """
    c = 16 if quick else 32
    warmup = 0.5 if quick else 1.0
    return [
        Scenario(
            "prefix_mix", "shared long system prompts, multi-turn chats: affinity on/off", kind="placement",
            concurrency=c, warmup_s=warmup,
            targets=("held", "affinity", "no-affinity", "peer-cache_aware", "peer-consistent_hash"),
        ),
        Scenario(
            "busy_elsewhere", "a consumer busy behind the router's back: reported load on/off", kind="placement",
            # One request at a time: the router's own in-flight count is then 0 on both consumers at
            # every choice, as for a replica whose traffic is small beside the others'. At 8, slow
            # requests pile up in flight on the busy consumer and in-flight alone already avoids it.
            concurrency=1, targets=("load-on", "load-off"), warmup_s=warmup,
        ),
        Scenario(
            "local_short", "short prompts: local decode on/off", kind="placement",
            concurrency=c, targets=("local", "disaggregated"), warmup_s=warmup,
        ),
    ]


# prefix_scarce's rows (``perf/load/scarce.py``): Narwhal per placement.policy, two replicas with
# requests alternating, the peer's two prefill policies, and the load generator's ideal placement.
SCARCE_ROWS = (
    "held", "affinity", "least_loaded", "held-2-replicas", "peer-consistent_hash", "peer-cache_aware", "ideal",
)


def scarce_scenarios(quick: bool) -> list[Scenario]:
    """The scarce-KV scenario in its three variants: run when named (``prefix_scarce`` names all)."""
    warmup = 0.5 if quick else 1.0
    titles = {
        "prefix_scarce_uniform": "8 shared prompts, 4 producers holding 2-3 each, multi-turn chats, uniform popularity",
        "prefix_scarce_zipf": "the same, prompt popularity Zipf s=1.1",
        "prefix_scarce_slow": "the same, uniform, one producer at half the prefill rate",
    }
    return [
        Scenario(name, title, kind="scarce", concurrency=32, warmup_s=warmup, targets=SCARCE_ROWS)
        for name, title in titles.items()
    ]


def select(scenarios: list[Scenario], spec: str | None, named_only: list[Scenario] | None = None) -> list[Scenario]:
    """``--scenarios a,b``: exact names or prefixes (``stream`` selects stream_c1, stream_c32 …).

    ``named_only`` scenarios (the placement ones) run only when ``--scenarios`` names them.
    """
    if not spec:
        return scenarios
    scenarios = [*scenarios, *(named_only or [])]
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    chosen = [s for s in scenarios if any(s.name == w or s.name.startswith(w) for w in wanted)]
    unknown = [w for w in wanted if not any(s.name == w or s.name.startswith(w) for s in scenarios)]
    if unknown:
        names = ", ".join(s.name for s in scenarios)
        raise SystemExit(f"perf: unknown scenario {unknown[0]!r} (known: {names})")
    return chosen


def ensure_targets(stack: Stack, scenario: Scenario) -> list[Target]:
    """Start the routers a scenario needs (the peer is started once, up front, or never)."""
    out: list[Target] = []
    for name in scenario.targets:
        if name in stack.targets:
            out.append(stack.targets[name])
        elif name == "narwhal":
            out.append(stack.narwhal("narwhal"))
        elif name == "baseline":
            baseline = stack.baseline()
            if baseline is not None:
                out.append(baseline)
        elif name == "narwhal-mem":
            out.append(stack.narwhal(name))
        elif name == "peer-mem" and stack.peer_template and "peer" in stack.targets:
            started = stack.start_peer(stack.peer_template, name)
            if started is not None:
                out.append(started)
        elif name == "aiohttp-floor":
            floor = stack.floor(name)
            if floor is not None:
                out.append(floor)
        elif name == "narwhal+log":
            out.append(stack.narwhal("narwhal+log", access_log=True))
        elif name.startswith("narwhal-w"):
            out.append(stack.narwhal(name, workers=int(name.removeprefix("narwhal-w"))))
        # "peer" / "baseline" when none runs: silently absent, the report says why
    return out


async def run_load(
    stack: Stack,
    scenario: Scenario,
    targets: list[Target],
    rounds: int,
    duration_s: float,
    profile_dir: Path | None = None,
) -> tuple[dict[str, list[RoundResult]], dict[str, Any] | None]:
    """Rounds of every target in rotating order, each on its own warm connection pool.

    With ``profile_dir``, one extra unmeasured round of the first Narwhal target runs under
    py-spy afterwards (a profiler costs CPU: it must not touch the measured rounds).
    """
    sessions = {t.name: new_session() for t in targets}
    results: dict[str, list[RoundResult]] = {t.name: [] for t in targets}
    profile: dict[str, Any] | None = None
    try:
        for r in range(rounds):
            k = r % len(targets)
            for target in targets[k:] + targets[:k]:
                if not target.alive():
                    raise RuntimeError(f"{target.name} is not running any more")
                result = await run_round(
                    sessions[target.name],
                    target.name,
                    target.url,
                    scenario.workload,
                    scenario.concurrency,
                    duration_s,
                    scenario.warmup_s,
                    stack.groups(),
                    prefill_url=target.prefill_url,
                )
                results[target.name].append(result)
        narwhal = [t for t in targets if t.kind == "narwhal"]
        if profile_dir is not None and narwhal:
            profile = await _profiled_round(
                stack, scenario, narwhal[0], sessions[narwhal[0].name], duration_s, profile_dir
            )
    finally:
        for session in sessions.values():
            await session.close()
    return results, profile


async def _profiled_round(
    stack: Stack, scenario: Scenario, target: Target, session: Any, duration_s: float, out_dir: Path
) -> dict[str, Any]:
    seconds = max(2.0, duration_s)
    try:
        profiler = Profiler(target.pids, seconds + scenario.warmup_s, out_dir, scenario.name)
    except FileNotFoundError as exc:
        return {"error": str(exc)}
    result = await run_round(
        session,
        target.name,
        target.url,
        scenario.workload,
        scenario.concurrency,
        seconds,
        scenario.warmup_s,
        stack.groups(),
    )
    paths = await asyncio.to_thread(profiler.wait)
    summary = summarize_profile(paths)
    summary["target"] = target.name
    summary["round_rps"] = round(result.requests / result.window_s, 1) if result.window_s else None
    return summary


@dataclass(slots=True)
class ScenarioResult:
    scenario: Scenario
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        s = self.scenario
        workload = {
            "endpoint": s.workload.endpoint,
            "stream": s.workload.stream,
            "tokens": s.workload.tokens,
            "narwhal_fake": s.workload.fault,
        }
        ceiling = None
        decode = (s.workload.fault or {}).get("decode") or {}
        if s.kind != "memory" and decode.get("token_delay_s") and s.workload.tokens > 1:
            # The fake sends the first token at once, then one every token_delay_s.
            ceiling = round(s.concurrency / ((s.workload.tokens - 1) * decode["token_delay_s"]), 1)
        return {
            "name": s.name,
            "title": s.title,
            "kind": s.kind,
            "concurrency": s.concurrency,
            "ceiling_rps": ceiling,
            "workload": workload if s.kind != "memory" else None,
            "expects_errors": s.expects_errors,
            "targets": self.stats,
            **self.extra,
        }
