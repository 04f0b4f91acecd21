"""The decode relay after the first token (narwhal.engines.relay.DirectRelay) on a fake connection.

:class:`FakeConn` has the five things the relay uses of ``engines.http1.Connection`` with the
same rules: bytes of one read go to ``sink`` while one is set and to the buffer otherwise (and
``take`` empties it), and ``wake`` wakes a waiter only if one waits now (a wake with nobody
waiting is lost, as in the real one). Tests wait for the relay to be parked in ``wait()``
before feeding it, each wait bounded, so nothing depends on how fast the machine is. The
silence and deadline timers run on a fake clock put in place of the relay's loop (its
``time`` and ``call_at``, the only two calls it makes of the loop), so their bounds are exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from narwhal.engines.relay import DirectRelay, Signal
from narwhal.engines.sse import SSEFramer

BOUND_S = 5.0  # every wait in these tests; none should take more than a few ms


class FakeConn:
    def __init__(self, *buffered: bytes) -> None:
        self.sink: Callable[[bytes], None] | None = None
        self.failed = False
        self.complete = False
        self._buffer = list(buffered)
        self._waiter: asyncio.Future[None] | None = None
        self.parked = asyncio.Event()  # set while someone waits in wait()

    # -- what the relay uses
    def take(self) -> list[bytes]:
        chunks, self._buffer = self._buffer, []
        return chunks

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        self.parked.set()
        try:
            await self._waiter
        finally:
            self._waiter = None
            self.parked.clear()

    # -- what the engine side does
    def read(self, data: bytes) -> None:
        """One socket read's body bytes, as ``Connection.data_received`` hands them on."""
        if self.sink is not None:
            self.sink(data)
        else:
            self._buffer.append(data)

    def end(self) -> None:
        self.complete = True
        self.wake()

    def fail(self) -> None:
        self.failed = True
        self.wake()


class Client:
    """The sink: records every span; ``behind_after`` spans in, it reports falling behind."""

    def __init__(self, behind_after: int | None = None) -> None:
        self.spans: list[bytes] = []
        self.behind_after = behind_after

    def __call__(self, span: bytes) -> bool:
        self.spans.append(span)
        return self.behind_after is None or len(self.spans) < self.behind_after


class FakeClock:
    """Stands in for the relay's loop: ``time()`` and ``call_at()``, fired by hand."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.timers: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], Any]) -> FakeTimer:
        timer = FakeTimer(when, callback)
        self.timers.append(timer)
        return timer

    def live(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled and not t.fired]

    def advance(self, to: float) -> None:
        """Time moves to ``to``; every live timer due by then fires, in order."""
        self.now = to
        for timer in sorted(self.live(), key=lambda t: t.when):
            if timer.when <= to and not timer.cancelled:
                timer.fired = True
                timer.callback()


class FakeTimer:
    def __init__(self, when: float, callback: Callable[[], Any]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False
        self.fired = False

    def cancel(self) -> None:
        self.cancelled = True


async def _parked(conn: FakeConn) -> None:
    async with asyncio.timeout(BOUND_S):
        await conn.parked.wait()


async def _finished(task: asyncio.Task[bytes | Signal]) -> asyncio.Task[bytes | Signal]:
    """The task, once it ended by itself: a relay still running after BOUND_S fails the test
    (rather than raising a TimeoutError that could pass for the relay's own)."""
    await asyncio.wait({task}, timeout=BOUND_S)
    assert task.done(), "the relay did not return"
    return task


async def _result(task: asyncio.Task[bytes | Signal]) -> bytes | Signal:
    return (await _finished(task)).result()


def _relay(conn: FakeConn, client: Client, *, read_timeout: float = 0.0, deadline: float | None = None,
           clock: FakeClock | None = None) -> DirectRelay:
    relay = DirectRelay(conn, SSEFramer(), client, read_timeout, deadline)  # type: ignore[arg-type]
    if clock is not None:
        relay._loop = clock  # type: ignore[assignment]
    return relay


async def test_spans_reach_the_client_in_order_exactly_once_until_the_engine_ends() -> None:
    # Two reads buffered before the relay starts, the second ending mid-event.
    conn, client = FakeConn(b"data: 1\n\n", b"data: 2\n\nda"), Client()
    task = asyncio.create_task(_relay(conn, client).run())
    await _parked(conn)
    assert client.spans == [b"data: 1\n\ndata: 2\n\n"]  # what was buffered: one span, one write
    conn.read(b"ta: 3\n\n")
    conn.read(b"data: 4\n\ndata: 5\n\n")
    conn.read(b"data: 6")  # an incomplete event is held by the framer, not sent
    conn.read(b"\n\n")
    conn.end()
    assert await _result(task) is Signal.HANDBACK  # the engine's end: the generator's read path reports it
    assert client.spans == [
        b"data: 1\n\ndata: 2\n\n", b"data: 3\n\n", b"data: 4\n\ndata: 5\n\n", b"data: 6\n\n",
    ]
    assert conn.sink is None  # withdrawn: later bytes stay with the connection


async def test_a_failed_connection_ends_the_relay_with_what_was_sent() -> None:
    conn, client = FakeConn(), Client()
    task = asyncio.create_task(_relay(conn, client).run())
    await _parked(conn)
    conn.read(b"data: 1\n\n")
    conn.fail()
    assert await _result(task) is Signal.HANDBACK
    assert client.spans == [b"data: 1\n\n"] and conn.sink is None


@pytest.mark.parametrize("end", [b"data: [DONE]\n\n", b'data: {"error": {"message": "boom", "code": 500}}\n\n'])
async def test_a_span_that_may_end_the_stream_comes_back_unsent_and_later_bytes_wait(end: bytes) -> None:
    conn, client = FakeConn(), Client()
    task = asyncio.create_task(_relay(conn, client).run())
    await _parked(conn)
    conn.read(b"data: 1\n\n")
    conn.read(b"data: 2\n\n" + end)
    conn.read(b"data: after\n\n")  # after the stop: not the client's, not lost
    assert await _result(task) == b"data: 2\n\n" + end  # the whole span, to be classified
    assert client.spans == [b"data: 1\n\n"]
    assert conn.sink is None
    assert conn.take() == [b"data: after\n\n"]


async def test_a_may_end_span_among_the_buffered_bytes_stops_before_any_wait() -> None:
    conn, client = FakeConn(b"data: 1\n\n", b"data: [DONE]\n\n"), Client()
    held = await _result(asyncio.create_task(_relay(conn, client).run()))
    assert held == b"data: 1\n\ndata: [DONE]\n\n" and client.spans == []
    assert not conn.parked.is_set()


async def test_a_client_that_falls_behind_stops_the_relay_and_a_second_run_resumes_exactly_once() -> None:
    conn, client = FakeConn(), Client(behind_after=2)
    relay = _relay(conn, client)
    task = asyncio.create_task(relay.run())
    await _parked(conn)
    conn.read(b"data: 1\n\n")
    conn.read(b"data: 2\n\n")  # written, but the client's transport is now above its high water
    conn.read(b"data: 3\n\n")
    assert await _result(task) is Signal.BEHIND  # the caller waits for the client, then runs again
    assert client.spans == [b"data: 1\n\n", b"data: 2\n\n"]
    assert conn.sink is None
    conn.read(b"data: 4\n\n")  # still stopped: buffered behind 3
    client.behind_after = None
    task = asyncio.create_task(relay.run())
    await _parked(conn)
    assert client.spans == [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\ndata: 4\n\n"]
    conn.read(b"data: 5\n\n")
    conn.end()
    assert await _result(task) is Signal.HANDBACK
    assert b"".join(client.spans) == b"".join(b"data: %d\n\n" % i for i in range(1, 6))


async def test_silence_longer_than_the_read_timeout_raises_at_its_exact_bound() -> None:
    clock = FakeClock(100.0)
    conn, client = FakeConn(), Client()
    relay = _relay(conn, client, read_timeout=0.5, clock=clock)
    task = asyncio.create_task(relay.run())
    await _parked(conn)
    assert [t.when for t in clock.live()] == [100.5]
    clock.now = 100.25
    conn.read(b"data: 1\n\n")  # resets the silence without re-arming: still one timer
    conn.read(b"data: 2\n\n")
    assert [t.when for t in clock.live()] == [100.5]
    clock.advance(100.5)  # the timer finds the last span 0.25 s ago: re-armed for its bound
    assert [t.when for t in clock.live()] == [100.75]
    assert not task.done()
    clock.advance(100.75)
    with pytest.raises(TimeoutError):
        (await _finished(task)).result()
    assert relay.timed_out_at == 100.75
    assert client.spans == [b"data: 1\n\n", b"data: 2\n\n"]
    assert conn.sink is None and clock.live() == []


async def test_the_deadline_bounds_the_relay_when_it_comes_first() -> None:
    clock = FakeClock(100.0)
    conn, client = FakeConn(), Client()
    relay = _relay(conn, client, read_timeout=10.0, deadline=100.2, clock=clock)
    task = asyncio.create_task(relay.run())
    await _parked(conn)
    assert [t.when for t in clock.live()] == [100.2]
    conn.read(b"data: 1\n\n")  # a span does not move the deadline
    clock.advance(100.2)
    with pytest.raises(TimeoutError):
        (await _finished(task)).result()
    assert relay.timed_out_at == 100.2 and client.spans == [b"data: 1\n\n"]


async def test_no_read_timeout_and_no_deadline_arm_no_timer_and_a_stop_cancels_the_one_armed() -> None:
    clock = FakeClock(100.0)
    conn, client = FakeConn(), Client()
    task = asyncio.create_task(_relay(conn, client, clock=clock).run())
    await _parked(conn)
    assert clock.timers == []
    conn.end()
    assert await _result(task) is Signal.HANDBACK

    clock = FakeClock(100.0)
    conn = FakeConn()
    task = asyncio.create_task(_relay(conn, client, read_timeout=1.0, clock=clock).run())
    await _parked(conn)
    conn.read(b"data: [DONE]\n\n")
    assert await _result(task) == b"data: [DONE]\n\n"
    assert [t.cancelled for t in clock.timers] == [True]  # no timer outlives the run


async def test_a_real_short_silence_times_out_within_its_bound() -> None:
    """The same rule on the real loop's timer: 50 ms of silence, waited for at most BOUND_S."""
    conn, client = FakeConn(), Client()
    relay = _relay(conn, client, read_timeout=0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    task = asyncio.create_task(relay.run())
    with pytest.raises(TimeoutError):
        (await _finished(task)).result()
    assert relay.timed_out_at is not None
    assert started + 0.05 <= relay.timed_out_at <= loop.time()
    assert loop.time() >= relay.timed_out_at and client.spans == []


@pytest.mark.parametrize(
    "reads",
    [
        [b"data: 1\n\n", b"data: 2\n\ndata: 3\n\n", b"data: 4\n\n"],  # whole events: the chunk is the span
        [b"data: 1\n\nda", b"ta: 2\n\n", b"data: 3\n\n"],  # held bytes: a whole-looking read still joins them
        [b"data: 1\n", b"\n", b"data: 2\n\n"],  # a separator split over reads
        [b"data: 1\r\n\r\n", b"data: 2\n\n"],  # a CR once: every later read is normalised too
        [b"data: 1\r", b"\n\r\ndata: 2\r\n\r\n", b"data: 3\r\r"],  # CRLF split after its CR, lone CRs
        [b"data: 1\n\n", b"data: 2\r\n\r\n", b"data: 3\n\n"],  # a CR first seen mid-stream
    ],
)
async def test_the_relays_common_case_frames_exactly_as_the_framer(reads: list[bytes]) -> None:
    # _on_body takes the framer's common case (whole LF events, nothing held) without calling it;
    # every read must still become the span SSEFramer.feed would return, byte for byte.
    framer = SSEFramer()
    expected = [span for span in (framer.feed(read) for read in reads) if span]
    conn, client = FakeConn(), Client()
    task = asyncio.create_task(_relay(conn, client).run())
    await _parked(conn)
    for read in reads:
        conn.read(read)
    conn.end()
    assert await _result(task) is Signal.HANDBACK
    assert client.spans == expected
