"""Reading the engines' own load (docs/behaviour.md "Placement"): every admitted engine's ``/metrics``, for the loop
to publish.

Every ``placement.load_interval_s`` the supervisor starts one read per admitted engine, all
in parallel, each bounded by the interval, with the TLS context and engine key of every other
control read (``engines.control.PooledReader``: ``ControlClient``'s answer over the pooled
HTTP/1.1 client, half its CPU per read). A reading is parsed
(``narwhal.supervisor.load_metrics``) into the engine's load record, with the time it was read and
this host's in-flight legs on the engine at that moment that the engine counted among its own
(``SharedFleet.engine_seen``: not a decode reserved for a prefill that still runs). The record
waits for the loop's next pass, which writes every reading taken since and bumps the load
generation once (``SharedFleet.publish_loads``: only the loop writes shared memory), so workers
pick them up on their next placement, lock-free, within a pass (~20 ms) of the answer. When the
placement policy's part wants them (``on_reading``, ``supervisor.policy_part``), each reading's
KV capacity and prefill counters go to it too (docs/behaviour.md "Placement"'s capacity bound and
the engine-reported prefill rate).

Invariants, and why:

* The loop never waits for a read: rounds are tasks, and an engine whose last read is still
  running is skipped, so a hung ``/metrics`` costs one pending task, never a late heartbeat.
  Nor does a round take a pass of the loop to itself: its reads start a batch per pass of the
  loop, over half the interval (``supervisor.rounds``), so a large fleet's round delays the
  heartbeat by one batch at most.
* A failed, slow or unparsable read is no breaker failure (health checks and requests judge
  engines): it publishes nothing, and the last reading goes stale in the workers' eyes
  (``placement.load_stale_s``). One log line per engine when its reads start failing, and no
  more than one a minute per engine: under load a busy engine's ``/metrics`` answers around the
  interval's bound, its reads flap between late and in time, and a line per flap (89 in one
  perf run) would bury the lines that matter.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from narwhal.engines.control import UNREACHABLE, ControlClient, ControlError, PooledReader
from narwhal.fleet import Engine
from narwhal.shm.records import LoadRecord
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.supervisor.load_metrics import PrefillCounters, parse_capacity, parse_load, parse_prefill
from narwhal.supervisor.rounds import Rounds

log = logging.getLogger("narwhal.supervisor.load")

WARN_EVERY_S = 60.0  # at most one "not read" line per engine this often


class LoadReader:
    """Reads engines' ``/metrics`` off the loop into load records; at most one read per engine at a time."""

    def __init__(
        self, shared: SharedFleet, control: PooledReader | ControlClient,
        on_reading: Callable[[int, int | None, PrefillCounters | None, float], None] | None = None,
        rounds: Rounds | None = None,
        on_connect: Callable[[Engine, bool, bool], None] | None = None,
    ) -> None:
        self.shared = shared
        self.control = control
        # The placement policy part's share of each reading: the KV capacity, the prefill counters.
        self.on_reading = on_reading
        self.rounds = rounds  # the loop's, whose passes start a round's reads; None: all at once
        # (engine, answered, refused): each read's word on reachability (docs/behaviour.md "Recovery")
        self.on_connect = on_connect
        self._reading: set[str] = set()
        self._failing: set[str] = set()
        self._warned_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._taken: list[tuple[int, LoadRecord]] = []  # (engine slot, record): read since the last take

    def take(self) -> list[tuple[int, LoadRecord]]:
        """The readings taken since the last call, for the loop to publish (``SharedFleet.publish_loads``)."""
        taken, self._taken = self._taken, []
        return taken

    def start_round(self, engines: Iterable[Engine], within_s: float = 0.0) -> None:
        """One read per engine not still being read, started a batch per pass of the loop over
        ``within_s`` seconds (``supervisor.rounds``; without rounds, at once); returns at once."""
        due = [e for e in engines if e.name not in self._reading]
        self._reading.update(e.name for e in due)
        starts = [functools.partial(self._start, e) for e in due]
        if self.rounds is not None:
            self.rounds.spread(starts, within_s)
            return
        for start in starts:
            start()

    def _start(self, engine: Engine) -> None:
        self._track(self._read(engine))

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, engine: Engine) -> None:
        answered = refused = False
        try:
            status, body = await self.control.get(engine, "/metrics")
            answered = True
            reading = parse_load(body) if status == 200 else None
            if reading is not None and self.on_reading is not None:
                self.on_reading(engine.index, parse_capacity(body), parse_prefill(body), time.monotonic())
            why = f"HTTP {status}" if status != 200 else "no vLLM load series in the answer"
        except ControlError as exc:
            reading, why = None, exc.reason
            refused = exc.reason == UNREACHABLE
        except Exception:  # a read must never take the supervisor down
            log.exception("load read of %s crashed", engine.name)
            reading, why = None, "crashed"
        finally:
            self._reading.discard(engine.name)
        if self.on_connect is not None:
            self.on_connect(engine, answered, refused)
        if reading is None:
            if engine.name not in self._failing:
                self._failing.add(engine.name)
                now = time.monotonic()
                if now - self._warned_at.get(engine.name, -WARN_EVERY_S) >= WARN_EVERY_S:
                    self._warned_at[engine.name] = now
                    log.warning("load of %s not read (%s): placement uses its in-flight counts only",
                                engine.name, why)
            return
        self._failing.discard(engine.name)
        # This host's legs on the engine now: the engine counted them too, and placement adds
        # them exactly from shared memory, so they are taken out of the reading there. Not the
        # decodes reserved for prefills still running: the engine has not seen those.
        at = self.shared.engine_slot(engine.name, engine.url)  # its engine slot (shm.table)
        if at is None:
            return
        ours = self.shared.engine_seen(at)
        self._taken.append((at, LoadRecord(
            time.monotonic(), reading.running, reading.waiting, reading.kv_usage, record_hash(engine.name, engine.url),
            ours,
        )))

    def cancel(self) -> None:
        """Cancel every read still running (the supervisor stopping)."""
        for task in self._tasks:
            task.cancel()
