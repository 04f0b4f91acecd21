"""What slow clients may hold of a worker's memory, in total (docs/behaviour.md "Slow clients").

Each stream's buffers are bounded on their own: a client's transport stops taking the relay's
spans above its high-water mark (the relay then waits for it, ``ClientStream.drain``), and the
engine's connection pauses its socket above ``engine.http1.HIGH_WATER`` bytes unread. But a
bound per stream is no bound for a worker: a thousand clients that stop reading each leave a
full transport buffer and a paused engine connection behind them.

So a stream that must wait for its client *charges* this worker's budget
(``server.max_buffered_mib``) with what it holds while it waits — its transport's buffer and
the engine side it may have paused — and gives it back when the wait ends, however it ends. A
stream whose charge would take the worker past its budget is cut at once (its client is too
slow for the memory the router can spare), counted in ``narwhal_slow_clients_cut_total`` by
why (``buffers_full``; a client that reads nothing for ``server.client_write_timeout_s``:
``write_timeout``), and its engine request aborted as for any client gone. Clients that keep up
never wait, and never charge anything: no work per span.

The transcripts of streams that may migrate (``request.migration.transcript``) count in the same
budget: each compacted block is *held* (:meth:`StreamBuffers.hold`) until its stream ends, and a
block the budget cannot take ends that stream's transcript instead (the stream is then not
continued after a cut) — memory is bounded in total, and no client is cut for a transcript.

Invariant: the total is the sum of the charges of the waits under way and of the transcripts'
holds, each given back exactly once; one instance per worker (one process, one loop: no lock).
"""

from __future__ import annotations

from narwhal import metrics
from narwhal.engines.http1 import HIGH_WATER

ENGINE_SIDE = HIGH_WATER
"""What a waiting stream's engine connection may hold unread before it pauses the socket."""


class BuffersFull(ConnectionResetError):
    """The worker's stream buffers are full: this client is cut (a lost client, to the router)."""


class StreamBuffers:
    """One worker's budget of bytes held for clients that are behind."""

    __slots__ = ("limit", "total", "waiting")

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.total = 0  # bytes charged by the waits under way
        self.waiting = 0  # streams waiting for their client

    def charge(self, client_buffer: int) -> int:
        """A stream starts waiting for its client, holding ``client_buffer`` bytes in its
        transport: its charge (give it back with :meth:`release`), or :class:`BuffersFull`."""
        charge = client_buffer + ENGINE_SIDE
        if self.total + charge > self.limit and self.waiting:
            cut()  # the first waiter always fits: a lone slow client is the write timeout's business
            raise BuffersFull("the client reads too slowly for the router's stream buffers")
        self.total += charge
        self.waiting += 1
        return charge

    def release(self, charge: int) -> None:
        """The wait that took ``charge`` ended (drained, cut, or the stream ended)."""
        self.total -= charge
        self.waiting -= 1

    def hold(self, size: int) -> bool:
        """A transcript keeps ``size`` more bytes, if the budget has them (False: it may not)."""
        if self.total + size > self.limit:
            return False
        self.total += size
        return True

    def free(self, size: int) -> None:
        """A transcript's held bytes are given back (its stream ended, or it stopped keeping)."""
        self.total -= size


def cut(why: str = "buffers_full") -> None:
    """Count a client cut for being too slow."""
    metrics.SLOW_CLIENTS_CUT.labels(why).inc()
