"""What every chaos phase drives: the fake fleet, the router under gunicorn, and the seeded load.

Why a module of its own: each phase (the fault mix in ``perf.chaos.run``, the poison storm, the
dead and the killed consumer, the soak) builds a :class:`Chaos` and drives it; with the class in
the command's module, every phase imported the module that imports every phase.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time
import uuid
from typing import Any

import aiohttp

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.chaos import checks
from perf.chaos.faults import (
    ADMIN_TOKEN,
    CLIENT_SLACK_S,
    CONSUMERS,
    DEADLINE_S,
    DECODE_READ_TIMEOUT_S,
    FIRST_TOKEN_TIMEOUT_S,
    KINDS,
    NO_ENGINE_BACKOFF_S,
    PREFILL_TIMEOUT_S,
    PRODUCERS,
    Expectation,
    Result,
    Window,
    body_for,
    classify,
    clean_expectation,
    judge,
    make_expectation,
)

LEASE_S = 60.0
FAULT_FRACTION = 0.3
# fds: upstream keep-alive pools and the client connections of the last burst come and go;
# +20 per process is far below one leaked socket per request (thousands) yet above pool churn.
# RSS: allocator high-water marks move by a few MB under load; +30 MB per process is well under
# what a per-request leak over 2,000 requests (>= 15 kB each) would add.
MAX_FDS_GROWTH = 20
MAX_RSS_GROWTH_KB = 30 * 1024
TAIL_S = 2.0  # requests keep flowing this long after the last fault window closed
# The KV accounting reads every request record of the run (perf.chaos.checks); the fake's
# default keeps the last 2,000 per engine, which a storm passes in seconds (a quick storm sent
# 6,065 requests in 8 s: every engine's list was full, covering only its last 5 to 7 s). About
# 2 kB a record: a full run's fleet stays within ~100 MB.
RECORDS_MAX = 50_000
ENGINE_EVENTS = ["stop_producer", "stop_consumer", "health_flap", "kv_read_fails"]
PROCESS_EVENTS = ["kill_worker", "kill_supervisor", "sighup"]


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)  # the requests, drawn in request order
        self.event_rng = random.Random(args.seed + 1)  # the engine/process faults: own stream
        self.windows: list[Window] = []
        self.done = 0
        self.fleet: FakeFleet | None = None
        self.router: RouterProcess | None = None
        self.config_path = ""
        self.states: list[tuple[float, str]] = []
        self.samples: list[tuple[float, dict[str, str]]] = []

    # -- processes ---------------------------------------------------------------------------

    def start(self, recovery: dict[str, Any] | None = None, out: str | None = None) -> None:
        """The fleet and the router; ``recovery`` overrides the suite's recovery settings (the
        poison storm's quarantine and ejection cap), ``out`` where logs go (default ``--out``)."""
        out = out or self.args.out
        self.fleet = FakeFleet.start(
            PRODUCERS + CONSUMERS,
            args=["--model", "fake-model", "--lease-s", str(LEASE_S), "--block-size", "4", "--token-delay-s", "0.01",
                  "--records-max", str(RECORDS_MAX)],
        )
        engines = [{"name": n, "role": "producer", "url": self.fleet.engines[n]} for n in PRODUCERS]
        engines += [{"name": n, "role": "consumer", "url": self.fleet.engines[n]} for n in CONSUMERS]
        sections: dict[str, dict[str, Any]] = {
            "server": {"workers": 2, "admin_token": ADMIN_TOKEN, "graceful_timeout_s": 15},
            "request": {"deadline_s": 30},
            "engine": {"prefill_timeout_s": PREFILL_TIMEOUT_S, "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S,
                       "decode_read_timeout_s": DECODE_READ_TIMEOUT_S},
            "placement": {"queue_timeout_s": 3},
            "handoff": {"lease_s": LEASE_S},  # the fakes' (--lease-s): max_age_s stays its default below it
            "preflight": {"on_start": False},
            "log": {"level": "warning", "access_log": os.path.join(out, "access.log")},
            "recovery": {"max_retries": 1, "eject_after": 3, "readmit_interval_s": 0.25,
                         "readmit_interval_max_s": 0.5, "health_interval_s": 0.5, **(recovery or {})},
        }
        self.config_path = write_config(engines, sections)
        self.router = RouterProcess.start(self.config_path, log_path=os.path.join(out, "router.log"))

    def stop(self) -> None:
        try:
            if self.router is not None:
                self.router.stop()
        finally:
            if self.fleet is not None:
                self.fleet.stop()
            if self.config_path and os.path.exists(self.config_path):
                os.unlink(self.config_path)

    def control(self, method: str, path: str, body: Any = None) -> Any:
        assert self.fleet is not None
        return self.fleet.control_request(method, path, body)

    # -- the schedule ------------------------------------------------------------------------

    def open_window(self, kind: str, engine: str | None) -> Window:
        w = Window(kind, engine, time.monotonic(), wall_start=time.time())
        self.windows.append(w)
        return w

    @staticmethod
    def close_window(w: Window) -> None:
        w.end, w.wall_end = time.monotonic(), time.time()

    async def engine_event(self, kind: str) -> None:
        engine = self.event_rng.choice(CONSUMERS if kind == "stop_consumer" else PRODUCERS if kind in (
            "stop_producer", "kv_read_fails") else PRODUCERS + CONSUMERS)
        # Stops last longer than eject_after x health_interval (1.5 s): the breaker must take the
        # engine out during the window (checked in breaker_schedule).
        hold = self.event_rng.uniform(2.0, 3.0) if kind != "kv_read_fails" else self.event_rng.uniform(1.0, 2.5)
        w = self.open_window(kind, engine)
        try:
            if kind in ("stop_producer", "stop_consumer"):
                await asyncio.to_thread(self.control, "POST", f"/engines/{engine}/stop")
            elif kind == "health_flap":
                await asyncio.to_thread(self.control, "PUT", f"/engines/{engine}/faults", {"health_status": 503})
            else:
                await asyncio.to_thread(self.control, "PUT", f"/engines/{engine}/faults", {"kv_read_fails": True})
            await asyncio.sleep(hold)
        finally:
            if kind.startswith("stop"):
                await asyncio.to_thread(self.control, "POST", f"/engines/{engine}/start")
            else:
                await asyncio.to_thread(self.control, "DELETE", f"/engines/{engine}/faults")
            self.close_window(w)

    async def process_event(self, kind: str) -> None:
        assert self.router is not None
        roles = checks.router_roles(self.router.proc.pid)
        w = self.open_window(kind, None)
        if kind == "kill_worker" and roles["worker"]:
            os.kill(self.event_rng.choice(roles["worker"]), signal.SIGKILL)
        elif kind == "kill_supervisor" and roles["supervisor"]:
            os.kill(roles["supervisor"][0], signal.SIGKILL)
        elif kind == "sighup":
            os.kill(self.router.proc.pid, signal.SIGHUP)
        else:
            w.kind += "_skipped"
        await asyncio.sleep(1.0)
        self.close_window(w)
        await asyncio.sleep(1.5)  # gunicorn respawns a worker / the master the supervisor before the next

    async def track(self, events: list[str], runner: Any) -> None:
        """Fire ``events`` one after the other, the i-th once i/(n+1) of the requests are done."""
        total = self.args.requests
        for i, kind in enumerate(events):
            target = total * (i + 1) / (len(events) + 1)
            while self.done < target:
                await asyncio.sleep(0.05)
            await runner(kind)

    # -- requests ----------------------------------------------------------------------------

    async def one(self, session: aiohttp.ClientSession, idx: int, exp: Expectation, chat: bool) -> Result:
        assert self.router is not None
        res = Result(idx, exp.kind)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = body_for(exp, f"chaos{idx}-{uuid.uuid4().hex[:8]}", chat)
        res.start = time.monotonic()
        try:
            async with session.post(self.router.url + path, json=body,
                                    headers={"x-narwhal-deadline-s": str(DEADLINE_S)}) as resp:
                raw = await resp.read()
                res.end = time.monotonic()
                res.outcome, res.tokens, res.problem = classify(resp.status, resp.headers, raw)
        except TimeoutError:
            res.end, res.outcome, res.problem = time.monotonic(), "violation", "no answer within deadline + slack"
        except aiohttp.ClientError as exc:
            res.end, res.outcome, res.problem = time.monotonic(), "conn_error", f"{type(exc).__name__}: {exc}"
        judge(res, exp, self.windows, strict=self.args.strict)
        return res

    def breaker_schedule(self) -> list[str]:
        """Every engine stopped (refusing connections) was seen out of placement meanwhile.

        Health flaps are not checked: a 503 /health counts as a failure, but an engine that still
        completes streams has its streak reset by them (docs/behaviour.md "Recovery": the check is for *idle* dead
        engines), so under traffic a flapping engine may rightly stay admitted."""
        problems = []
        restarts = [w for w in self.windows if w.kind in ("kill_supervisor", "sighup")]
        for w in self.windows:
            if w.kind not in ("stop_producer", "stop_consumer") or w.engine is None:
                continue
            if any(r.start <= w.end and r.end + 1.0 >= w.start for r in restarts):
                continue  # no breakers while the supervisor restarts (docs/behaviour.md "Processes"): not checkable
            seen = {st[w.engine] for t, st in self.samples if w.start <= t <= w.end + 1.0}
            if seen and seen <= {"admitted"}:
                problems.append(f"{w.engine} stayed admitted through {w.kind} ({w.end - w.start:.1f} s)")
        return problems

    async def monitor(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        """Sample breaker states every 0.25 s: the report shows them next to the schedule."""
        assert self.router is not None
        last = ""
        while not stop.is_set():
            try:
                async with session.get(self.router.url + "/admin/engines",
                                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
                    engines = (await resp.json())["engines"]
                now = " ".join(f"{e['name']}={e['state']}" for e in engines)
                self.samples.append((time.monotonic(), {e["name"]: e["state"] for e in engines}))
                if now != last:
                    self.states.append((time.monotonic(), now))
                    last = now
            except (aiohttp.ClientError, ValueError, KeyError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except TimeoutError:
                pass

    async def drive(self, total: int, concurrency: int, tracks: bool, faults: float = 0.3) -> list[Result]:
        """Send at least ``total`` requests from ``concurrency`` clients; with ``tracks``, keep
        sending until every scheduled engine/process fault window has closed (plus a short tail),
        so no fault happens on an idle router."""
        kinds: list[str] = []  # fault kinds in seeded rounds of the catalogue: a short run meets all

        def expectation() -> tuple[Expectation, bool]:
            nonlocal kinds
            if self.rng.random() < faults:
                if not kinds:
                    kinds = list(KINDS)
                    self.rng.shuffle(kinds)
                exp = make_expectation(self.rng, PRODUCERS, CONSUMERS, kinds.pop())
            else:
                exp = clean_expectation(self.rng)
            return exp, self.rng.random() < 0.3

        rounds = 2 if total >= 1000 else 1
        engine_events = ENGINE_EVENTS * rounds
        process_events = PROCESS_EVENTS * rounds
        self.event_rng.shuffle(engine_events)
        self.event_rng.shuffle(process_events)
        tail_until = [float("inf") if tracks else 0.0]

        def requests() -> Any:
            idx = 0
            while idx < total or time.monotonic() < tail_until[0]:
                yield idx, *expectation()
                idx += 1

        queue = requests()
        results: list[Result] = []
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S + CLIENT_SLACK_S)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async def worker() -> None:
                for idx, exp, chat in queue:
                    res = await self.one(session, idx, exp, chat)
                    results.append(res)
                    self.done += 1
                    if res.outcome == "http:503:no_engine":
                        await asyncio.sleep(NO_ENGINE_BACKOFF_S)

            async def schedule() -> None:
                await asyncio.gather(self.track(engine_events, self.engine_event),
                                     self.track(process_events, self.process_event))
                tail_until[0] = time.monotonic() + TAIL_S

            background = [asyncio.create_task(schedule())] if tracks else []
            stop = asyncio.Event()
            mon = asyncio.create_task(self.monitor(session, stop))
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            stop.set()
            await mon
            await asyncio.gather(*background)
        return results
