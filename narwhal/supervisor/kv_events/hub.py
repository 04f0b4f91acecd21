"""The supervisor's KV-event subscriptions: one per engine per router host (never per worker).

Each engine's publishers are found at ``GET /kv_event_sources`` (vLLM 0.31 on: its publisher's
config by DP rank; a wildcard host in an endpoint is the engine's own host) and subscribed with
a ZMQ SUB for the live stream and a DEALER for replay (``[b"", start_seq]``, answered batch by
batch until the end marker). What each batch says goes to that engine's
:class:`~narwhal.supervisor.kv_events.stream.Stream`; a gap is replayed at once; a gap the replay
cannot fill, a restart and an ``AllBlocksCleared`` are *resets*, which the supervisor takes as
"this engine's cache is not what was known": its learned holdings are dropped at once
(``on_reset``). An engine with no publisher, or whose stream is not in order yet, is on learned
holdings (``source``); engines that join or leave subscribe or unsubscribe (:meth:`follow`).

Only DP rank 0 is followed (one engine entry is one rank to the router). Events carry no
incarnation, so an engine's restart shows as a sequence back at 0 (or, when its first batches
were missed, as a gap whose replay starts late): both reset.

Invariant: whatever a publisher or ``/kv_event_sources`` sends, nothing raises out of a
subscription: a bad answer is logged once per engine and the engine stays on learned holdings;
a subscription that fails is retried after :data:`RETRY_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from yarl import URL

from narwhal import metrics
from narwhal.supervisor.kv_events.decode import Unreadable, decode_batch
from narwhal.supervisor.kv_events.stream import APPLIED, DUPLICATE, GAP, RESTART, Stream

log = logging.getLogger("narwhal.supervisor.kv_events")

RETRY_S = 5.0  # a subscription that failed (an engine down, a publisher gone) tries again
NO_PUBLISHER_S = 30.0  # an engine that publishes nothing (events off, a release before 0.31) is asked again
# For this long after a subscription begins, prefills to the engine ask for the full report of the
# blocks they reuse (vLLM's kv_cache_report_mode, 0.26 on): a cache hit publishes nothing, so what
# the engine cached before this router subscribed is learned as requests reuse it (docs/behaviour.md
# "Placement"); afterwards the events alone keep the picture, at no extra event per hit.
REPORT_FULL_S = 300.0
REPLAY_IDLE_S = 2.0  # a replay that sends nothing for this long is over (the gap not filled)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SOURCES_PATH = "/kv_event_sources"


def endpoints(sources: Any, engine_url: str) -> tuple[str, str | None, str] | None:
    """(PUB endpoint, replay endpoint, topic) of DP rank 0 from a ``/kv_event_sources`` answer
    (vLLM's dict keyed by rank, or the list shape some trees return); a wildcard host becomes the
    engine's own. None: events are off, or the answer is not one."""
    if isinstance(sources, dict):
        first = sources.get("0")
    elif isinstance(sources, list):
        first = next((s for s in sources if isinstance(s, dict) and s.get("data_parallel_rank", 0) == 0), None)
    else:
        return None
    if not isinstance(first, dict) or first.get("enable_kv_cache_events") is False:
        return None
    pub, replay, topic = first.get("endpoint"), first.get("replay_endpoint"), first.get("topic") or ""
    if not isinstance(pub, str) or not pub.startswith(("tcp://", "ipc://")) or not isinstance(topic, str):
        return None  # (an ipc:// publisher is the router's own host's: as it stands)
    host = URL(engine_url).host or "127.0.0.1"
    return (_resolved(pub, host), _resolved(replay, host) if isinstance(replay, str) else None, topic)


def _resolved(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` (or ``0.0.0.0``, ``::``) is the engine's own host; ``ipc://`` as it is."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint.removeprefix("tcp://")
    bind_host, _, port = rest.rpartition(":")
    if bind_host in ("*", "0.0.0.0", "[::]", "::", ""):
        return f"tcp://{host}:{port}"
    return endpoint


class KvEventsHub:
    """Every engine's subscription (the module's text)."""

    def __init__(self, session: aiohttp.ClientSession, on_reset: Callable[[str, str], None]) -> None:
        self._session = session
        self._on_reset = on_reset  # (engine name, why): its learned holdings are not to be counted on
        self._ctx = zmq.asyncio.Context.instance()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.streams: dict[str, Stream] = {}
        self.version = 0  # moves whenever an engine's source moves (the supervisor publishes then)
        self._said: set[str] = set()

    def source(self, name: str) -> str:
        """``events`` when the engine's stream is in order, else ``learned``."""
        stream = self.streams.get(name)
        return "events" if stream is not None and stream.in_sync else "learned"

    def follow(self, engines: Iterable[tuple[str, str]]) -> None:
        """Subscribe the engines (name, URL) not yet followed; end the subscriptions of the others."""
        wanted = dict(engines)
        for name in [n for n in self._tasks if n not in wanted]:
            self._tasks.pop(name).cancel()
            if self.streams.pop(name, None) is not None:
                self.version += 1
        for name, url in wanted.items():
            if name not in self._tasks:
                self._tasks[name] = asyncio.ensure_future(self._follow_forever(name, url))

    def close(self) -> None:
        """End every subscription (the supervisor stops)."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def _follow_forever(self, name: str, url: str) -> None:
        while True:
            pause = RETRY_S
            try:
                if not await self._follow(name, url):
                    pause = NO_PUBLISHER_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a subscription must never take the supervisor down
                self._say(name, f"engine {name}: KV events not followed ({type(exc).__name__}: {exc}); "
                                "its holdings are learned from traffic")
            self._set_stream(name, None)
            await asyncio.sleep(pause)

    async def _sources(self, name: str, url: str) -> tuple[str, str | None, str] | None:
        try:
            async with self._session.get(url + _SOURCES_PATH, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return None
                return endpoints(await resp.json(content_type=None), url)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _follow(self, name: str, url: str) -> bool:
        """Follow the engine's publisher until it fails; False at once when it has none."""
        found = await self._sources(name, url)
        if found is None:
            return False  # no publisher (events off, a release before 0.31, or the engine down): learned
        pub, replay, topic = found
        sub = self._ctx.socket(zmq.SUB)
        dealer = self._ctx.socket(zmq.DEALER) if replay else None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(pub)
            if dealer is not None and replay is not None:
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(replay)
            stream = Stream()
            stream.report_until = time.monotonic() + REPORT_FULL_S
            self._set_stream(name, stream)
            self._said.discard(name)
            log.info("engine %s: following its KV events at %s", name, pub)
            while True:
                frames = await sub.recv_multipart()
                await self._live(name, stream, frames, dealer)
        finally:
            sub.close(0)
            if dealer is not None:
                dealer.close(0)

    async def _live(self, name: str, stream: Stream, frames: list[bytes], dealer: zmq.asyncio.Socket | None) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._unreadable(name, stream, "a message that is not [topic, seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            ts, events = decode_batch(frames[2])
        except Unreadable as exc:
            self._unreadable(name, stream, str(exc))
            return
        was = stream.in_sync
        verdict = stream.live(seq, frames[2], events)
        metrics.KV_EVENTS.labels(name, verdict).inc()
        if verdict == GAP:
            asked = stream.next_seq if stream.next_seq is not None else 0
            metrics.KV_EVENT_GAPS.labels(name).inc()
            filled = await self._replay(name, stream, dealer, asked, seq)
            if not filled and was:
                self._reset(name, stream, "a gap its replay could not fill")
            if stream.live(seq, frames[2], events) not in (APPLIED, DUPLICATE):
                stream.accept(seq, frames[2], events)  # what the replay brought does not reach it: from here
        elif verdict == RESTART:
            self._reset(name, stream, "its sequence started again (a restarted engine)")
        if stream.cleared:
            stream.cleared = False
            self._reset(name, stream, "it cleared its cache (AllBlocksCleared)")
        metrics.KV_EVENT_LAG.labels(name).set(max(time.time() - ts, 0.0))
        metrics.KV_EVENT_BLOCKS.labels(name).set(len(stream.blocks))
        if stream.in_sync != was:
            self.version += 1

    async def _replay(self, name: str, stream: Stream, dealer: zmq.asyncio.Socket | None, asked: int,
                      until: int) -> bool:
        """Ask the replay socket for ``[asked, until)``; whether it filled the gap."""
        if dealer is None:
            metrics.KV_EVENT_REPLAYS.labels(name, "no_replay").inc()
            return stream.replayed(asked, until, [])
        await dealer.send_multipart([b"", asked.to_bytes(8, "big")])
        batches = []
        with contextlib.suppress(TimeoutError):
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_IDLE_S)
                if len(frames) == 4:  # 0.26 on: [b"", topic, seq, payload]
                    frames = [frames[0], *frames[2:]]
                if len(frames) != 3 or frames[1] == END_SEQ:
                    break
                try:
                    _, events = decode_batch(frames[2])
                except Unreadable:
                    break
                batches.append((int.from_bytes(frames[1], "big"), frames[2], events))
        filled = stream.replayed(asked, until, batches)
        metrics.KV_EVENT_REPLAYS.labels(name, "filled" if filled else "unfilled").inc()
        return filled

    def _unreadable(self, name: str, stream: Stream, why: str) -> None:
        self._say(name, f"engine {name}: a KV-event message could not be read ({why}): its holdings are learned "
                        "until its stream is in order again")
        if stream.in_sync:
            self._reset(name, stream, "an unreadable message")
            self.version += 1

    def _reset(self, name: str, stream: Stream, why: str) -> None:
        metrics.KV_EVENT_RESETS.labels(name).inc()
        log.warning("engine %s: its KV-cache holdings dropped: %s", name, why)
        self._on_reset(name, why)

    def _set_stream(self, name: str, stream: Stream | None) -> None:
        if stream is None:
            if self.streams.pop(name, None) is not None:
                self.version += 1
        else:
            self.streams[name] = stream
            self.version += 1

    def _say(self, name: str, line: str) -> None:
        if name not in self._said:
            self._said.add(name)
            log.warning("%s", line)
