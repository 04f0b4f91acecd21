"""Spreading client connections over the workers.

gunicorn's workers share one listening socket, and the event loop (libuv, under uvloop)
accepts *every* pending connection each time that socket is readable. A burst of new
connections — a load balancer reconnecting, a client's pool opening — therefore lands on
whichever worker woke first, and with keep-alive it stays there: measured here, 32
connections opened together went 32 to one worker and 0 to the other, and that one worker's
loop did the work of both.

So each worker accepts by itself (:class:`BalancedSite` in place of aiohttp's ``SockSite``),
one connection per readiness, and publishes how many client connections it holds in its
shared-memory slot. A worker holding :data:`LEAD` or more connections than the least loaded
worker that is accepting pauses its accepts after each one (:func:`pause_after`: longer the
further ahead, at most :data:`MAX_PAUSE_S`), which leaves a burst to the others. It is a
rate limit, not a hand-off: with a worker stuck or slow to wake, each of the others still
accepts at least one connection per ``MAX_PAUSE_S``, so nothing waits on it for long.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Protocol

from aiohttp import web

log = logging.getLogger("narwhal.worker.accept")

LEAD = 2  # a worker this many connections ahead of the least loaded one slows down
PAUSE_S = 0.0005  # per connection of lead: between two accepts of a worker that is ahead
MAX_PAUSE_S = 0.002  # so a stuck worker costs the others at most this per accept
_ERROR_PAUSE_S = 0.1  # after an accept failure (e.g. out of file descriptors)
# A stopping worker still reads requests this long on connections it accepted just before
# (a client sends its request within a round trip of connecting): SIGTERM's wake waits it out
# (``narwhal.worker.lifecycle``), and so does a site's stop (a ``max_requests`` retirement).
ACCEPTED_GRACE_S = 0.25

# The gunicorn worker's listening sockets, taken over in ``lifecycle.post_worker_init`` (before the app
# is built) so that aiohttp's worker starts no SockSite of its own; empty outside gunicorn.
LISTENERS: list[socket.socket] = []


def take_listeners() -> list[socket.socket]:
    """The gunicorn sockets this worker accepts from, handed over once (empty the second time, and outside gunicorn)."""
    taken = LISTENERS[:]
    LISTENERS.clear()
    return taken


class ConnectionShare(Protocol):
    """Where a worker publishes its connection count and reads the other workers'."""

    def publish(self, connections: int | None) -> None:
        """Publish this worker's client connections; None: it is not accepting."""

    def least_other(self) -> int | None:
        """The fewest connections of another worker that is accepting; None when there is none."""


def pause_after(mine: int, least_other: int | None) -> float:
    """How long a worker holding ``mine`` connections leaves the next ones to the others."""
    if least_other is None or mine < least_other + LEAD:
        return 0.0
    return min(PAUSE_S * (mine - least_other), MAX_PAUSE_S)


class BalancedSite(web.BaseSite):
    """A listening socket this worker accepts from itself, one connection at a time."""

    __slots__ = ("_sock", "_name", "_share", "_loop", "_reading", "_resume", "_connecting", "_accepted_at",
                 "_handler")

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, share: ConnectionShare | None) -> None:
        super().__init__(runner)
        self._sock = sock
        if sock.family == socket.AF_UNIX:
            self._name = f"http://unix:{sock.getsockname()}:"
        else:
            host, port = sock.getsockname()[:2]
            self._name = f"http://{host}:{port}"
        self._share = share
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._resume: asyncio.TimerHandle | None = None
        # Accepted, and not yet known to have made its connection: counted beside the server's
        # connections until the connect task is done, so for a moment twice (it errs on pausing).
        self._connecting: set[asyncio.Future[Any]] = set()
        self._accepted_at = float("-inf")  # loop time of the last accept
        self._handler: web.Server | None = None

    @property
    def name(self) -> str:
        """The listening address as aiohttp names a site (``http://host:port`` or unix)."""
        return self._name

    async def start(self) -> None:
        """Start accepting from the socket ourselves, one connection per readiness."""
        await super().start()
        self._handler = self._runner.server
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._publish()
        self._read()

    @property
    def connecting(self) -> int:
        """Connections accepted whose connection is still being made."""
        return len(self._connecting)

    async def stop(self) -> None:
        """Accept no more; give what was accepted in the last ``ACCEPTED_GRACE_S`` its
        connection and the rest of that time to send its request; then stop as any aiohttp site.

        Without the wait a worker retiring at ``max_requests`` (its loop ends at once, with no
        SIGTERM's grace) lost a connection it had just accepted: aiohttp's stop closed it before
        its request, or, still being made, did not know it, and it waited out the graceful
        timeout for a request aiohttp's ``data_received`` drops once the server is closing."""
        self.stop_accepting()
        if self._connecting:
            await asyncio.wait(set(self._connecting))
        if self._loop is not None:
            rest = self._accepted_at + ACCEPTED_GRACE_S - self._loop.time()
            if rest > 0:
                await asyncio.sleep(rest)
        await super().stop()

    def stop_accepting(self) -> None:
        """Accept no more (SIGTERM): connections still queued go to the other workers."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._unread()
        if self._share is not None:
            self._share.publish(None)
        self._share = None
        self._handler = None

    # -- accepting ------------------------------------------------------------------------

    def _read(self) -> None:
        self._resume = None
        if self._handler is not None and not self._reading and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept_one)
            self._reading = True

    def _unread(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _pause(self, seconds: float) -> None:
        assert self._loop is not None
        self._unread()
        self._resume = self._loop.call_later(seconds, self._read)

    def _accept_one(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return  # another worker took it
        except OSError as exc:
            log.warning("accept failed: %s; pausing accepts for %g s", exc, _ERROR_PAUSE_S)
            self._pause(_ERROR_PAUSE_S)
            return
        conn.setblocking(False)
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._loop is not None and self._handler is not None
        self._accepted_at = self._loop.time()
        made = asyncio.ensure_future(self._loop.connect_accepted_socket(self._handler, conn))
        self._connecting.add(made)
        made.add_done_callback(lambda task: self._made(task, conn))
        pause = self._publish()
        if pause:
            self._pause(pause)

    def _made(self, task: asyncio.Future[Any], conn: socket.socket) -> None:
        self._connecting.discard(task)
        if task.cancelled() or task.exception() is not None:
            conn.close()

    def _publish(self) -> float:
        """Publish this worker's count; return how long to pause its accepts (0: none)."""
        share = self._share
        if share is None or self._handler is None:
            return 0.0
        mine = len(self._handler.connections) + len(self._connecting)
        share.publish(mine)
        return pause_after(mine, share.least_other())
