"""The closed-loop load generator: N virtual users, each sending its next request when the last ends.

Why closed loop: a router's cost shows up as lower throughput and higher latency at a fixed
number of users, which is how the issue states its targets (concurrency 1, 32, 128, 1,000), and
a closed loop can never build an unbounded backlog on a small shared machine.

Why so little work per chunk: on a 2-core host the load generator competes with the router and
the engines for the same CPUs (``perf.load.reading`` reads each answer with as little as it can).

What is measured in a round: requests *completed* inside the window [t0, t1) after a warm-up,
with CPU snapshots of every process group taken at t0 and t1, so CPU per request divides the CPU
spent in the window by the requests completed in it (steady state). Errors are counted over the
whole round, warm-up and drain included: an error is never hidden by timing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from narwhal.engines.connector import PREFILL_KV_PARAMS
from perf.load import pd_endpoints, procs
from perf.load.reading import Outcome, error_key, read_body, read_stream

MODEL = "fake-model"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# 32 words: the fake counts words as tokens, so a prefill pins 2 KV blocks of 16.
PROMPT = " ".join(f"word{i}" for i in range(32))
HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class Workload:
    """What every request of a scenario looks like (the same bytes go to every target)."""

    endpoint: str = COMPLETIONS
    stream: bool = True
    tokens: int = 16
    fault: Mapping[str, Any] | None = None  # the fake engine's per-request ``narwhal_fake``
    system_chars: int = 0  # chat: a system prompt this long before the user's message (chat_long)

    def data(self) -> dict[str, Any]:
        if self.endpoint in pd_endpoints.ENDPOINTS:
            return pd_endpoints.data(self.endpoint, MODEL, PROMPT, self.tokens, self.stream, self.fault)
        data: dict[str, Any] = {"model": MODEL, "max_tokens": self.tokens, "stream": self.stream}
        if self.endpoint == CHAT:
            system = [{"role": "system", "content": system_text(self.system_chars)}] if self.system_chars else []
            data["messages"] = [*system, {"role": "user", "content": PROMPT}]
        else:
            data["prompt"] = PROMPT
        if self.fault is not None:
            data["narwhal_fake"] = dict(self.fault)
        return data

    def body(self) -> bytes:
        return orjson.dumps(self.data())

    def paced_s(self) -> float:
        """How long the fake engine takes to send one answer's tokens (0 when it is not paced)."""
        delay = (self.fault or {}).get("decode", {}).get("token_delay_s", 0.0)
        return float(delay) * self.tokens

    def prefill_body(self) -> bytes:
        """The producer leg as a PD proxy sends it (docs/behaviour.md "Prefill"), for the client-side
        PD floor.
        """
        data = self.data()
        data.update(stream=False, max_tokens=1, ignore_eos=True, kv_transfer_params=PREFILL_KV)
        return orjson.dumps(data)


PREFILL_KV = PREFILL_KV_PARAMS  # exactly what the router sends a producer


def system_text(chars: int) -> str:
    """``chars`` characters of words and punctuation, as a long system prompt reads (not one run of a letter)."""
    sentence = "You are a careful assistant; answer briefly, cite the policy, and never guess. "
    return (sentence * (chars // len(sentence) + 1))[:chars]


@dataclass(frozen=True, slots=True)
class PdLegs:
    """``direct-pd``: the load generator itself does prefill then decode, as a zero-cost router would.

    It measures the floor any PD router has on this fleet (the prefill round trip and the
    consumer's KV read), so "router overhead" can be told apart from "PD overhead".
    """

    prefill_url: str
    prefill_body: bytes
    decode: dict[str, Any]


async def _pd_decode_body(session: aiohttp.ClientSession, legs: PdLegs) -> bytes | Outcome:
    async with session.post(legs.prefill_url, data=legs.prefill_body, headers=HEADERS) as resp:
        data = await resp.read()
        if resp.status != 200:
            return Outcome(False, error=f"prefill_{resp.status}")
    try:
        descriptor = orjson.loads(data)["kv_transfer_params"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return Outcome(False, error="prefill_no_descriptor")
    return orjson.dumps({**legs.decode, "kv_transfer_params": descriptor})


def new_session() -> aiohttp.ClientSession:
    """One pooled session per target: no connection cap (aiohttp's default is 100)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60, enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, timeout_s: float, pd: PdLegs | None = None
) -> Outcome:
    """Send one request and read all of it; never raises (failures become ``Outcome.error``)."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            if pd is not None:
                decode = await _pd_decode_body(session, pd)
                if isinstance(decode, Outcome):
                    return decode
                body = decode
            async with session.post(url, data=body, headers=HEADERS) as resp:
                if resp.status != 200:
                    return Outcome(False, error=error_key(resp.status, await resp.read()))
                out = await (read_stream(resp, start) if stream else read_body(resp, start))
    except TimeoutError:
        return Outcome(False, error="timeout")
    except (aiohttp.ClientError, OSError) as exc:
        return Outcome(False, error=type(exc).__name__)
    out.total = time.perf_counter() - start
    return out


Groups = Mapping[str, list[int]]


@dataclass(slots=True)
class Snapshot:
    at: float
    cpu: dict[str, dict[str, float]]  # group -> role -> CPU seconds so far
    client: float
    host: procs.HostCpu

    @classmethod
    def take(cls, groups: Groups) -> Snapshot:
        return cls(
            time.perf_counter(),
            {name: procs.cpu_by_role(pids) for name, pids in groups.items()},
            procs.self_cpu_seconds(),
            procs.HostCpu.read(),
        )


@dataclass(slots=True)
class RoundResult:
    """One target, one round: raw samples plus CPU deltas of every process group."""

    target: str
    window_s: float = 0.0
    requests: int = 0
    tokens: int = 0
    ttfb: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    cpu: dict[str, float] = field(default_factory=dict)  # group -> CPU seconds in the window
    cpu_roles: dict[str, dict[str, float]] = field(default_factory=dict)  # group -> role -> seconds
    client_cpu: float = 0.0
    host: dict[str, float] = field(default_factory=dict)  # HostCpu.delta: tasks, irq, steal, total
    unfinished: int = 0


WARMUP_CAP_S = 10.0  # the longest a round waits for every user's first answer


async def run_round(
    session: aiohttp.ClientSession,
    target: str,
    url: str,
    workload: Workload,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    groups: Groups,
    timeout_s: float = 60.0,
    drain_s: float = 30.0,
    prefill_url: str | None = None,
) -> RoundResult:
    """Closed loop at ``concurrency`` users against ``url`` for warm-up + ``duration_s``."""
    body = workload.body()
    full_url = url + workload.endpoint
    pd = None
    if prefill_url is not None:
        pd = PdLegs(prefill_url + workload.endpoint, workload.prefill_body(), workload.data())
    stream = workload.stream
    done_at: list[tuple[float, Outcome]] = []
    errors: Counter[str] = Counter()
    stop = False

    # Paced users start spread over one answer's length, so answers end evenly through the
    # window instead of in bunches of ``concurrency`` (a window would count 3 bunches or 4).
    stagger_s = workload.paced_s() / concurrency

    async def user(i: int) -> None:
        await asyncio.sleep(i * stagger_s)
        while not stop:
            out = await one_request(session, full_url, body, stream, timeout_s, pd)
            if out.ok:
                done_at.append((time.perf_counter(), out))
            else:
                errors[out.error] += 1
                await asyncio.sleep(0.01)  # an erroring target must not turn into a busy loop

    tasks = [asyncio.ensure_future(user(i)) for i in range(concurrency)]
    try:
        before, after = await _window(
            groups, warmup_s, duration_s, lambda: len(done_at) + sum(errors.values()) >= concurrency
        )
    except BaseException:  # cancelled (Ctrl-C, SIGTERM): stop at once, no drain
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    stop = True
    unfinished = await _drain(tasks, drain_s)
    return _tally(target, groups, before, after, done_at, errors, unfinished)


async def _window(
    groups: Groups, warmup_s: float, duration_s: float, settled: Callable[[], bool],
    on_edge: Callable[[], Awaitable[None]] | None = None,
) -> tuple[Snapshot, Snapshot]:
    """The measured window's edges: after the warm-up and once ``settled``, then ``duration_s`` on;
    ``on_edge`` runs at each (what a scenario reads beside the CPU, e.g. the engines' counters)."""
    await asyncio.sleep(warmup_s)
    # Steady state: every user has finished (or failed) a request, so the window does not
    # open on a cold start where nothing can finish yet (slow streams on a loaded host).
    settle_until = time.perf_counter() + WARMUP_CAP_S
    while not settled() and time.perf_counter() < settle_until:
        await asyncio.sleep(0.05)
    before = Snapshot.take(groups)
    if on_edge is not None:
        await on_edge()
    await asyncio.sleep(duration_s)
    after = Snapshot.take(groups)
    if on_edge is not None:
        await on_edge()
    return before, after


async def _drain(tasks: list[asyncio.Task[None]], drain_s: float) -> int:
    """Let the users finish their last request (up to ``drain_s``); cancel the rest, return how many."""
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    return len(pending)


def _tally(
    target: str,
    groups: Groups,
    before: Snapshot,
    after: Snapshot,
    done_at: list[tuple[float, Outcome]],
    errors: Counter[str],
    unfinished: int,
) -> RoundResult:
    """The round's figures: CPU deltas over the window, the requests completed inside it, all errors."""
    result = RoundResult(target)
    result.unfinished = unfinished
    result.window_s = after.at - before.at
    for name in groups:
        a, b = after.cpu[name], before.cpu[name]
        # A process that exited in between is in its parent's cutime after: roles can go negative
        # one by one, their sum cannot.
        result.cpu_roles[name] = {r: a.get(r, 0.0) - b.get(r, 0.0) for r in set(a) | set(b)}
        result.cpu[name] = sum(result.cpu_roles[name].values())
    result.client_cpu = after.client - before.client
    result.host = after.host.delta(before.host)
    for at, out in done_at:
        if before.at <= at < after.at:
            result.requests += 1
            result.tokens += out.tokens
            result.ttfb.append(out.ttfb)
            result.latency.append(out.total)
    result.errors = errors
    if result.unfinished:
        result.errors["unfinished_at_drain"] += result.unfinished
    return result


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of unsorted ``values``; None when empty."""
    if not values:
        return None
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


async def wait_until_serving(
    session: aiohttp.ClientSession, url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True
) -> None:
    """Poll a one-token completion until it answers 200 (a peer router's readiness)."""
    body = Workload(stream=False, tokens=1).body()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{url}: process exited before serving")
        out = await one_request(session, url + COMPLETIONS, body, False, 5.0)
        if out.ok:
            return
        last = out.error
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{url}: no 200 to a completion within {timeout_s:g}s (last: {last})")
