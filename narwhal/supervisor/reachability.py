"""Which engines cannot be reached now (docs/behaviour.md "Recovery", round 4): pure state the supervisor keeps.

An engine whose last connection attempt failed is *unreachable* until a connection to it
succeeds again. Placement weighs this above load and above the breaker's state whenever it has
to fall back (``narwhal.fleet.placement.fallback``): a consumer that refuses connections fails
fast, so it looks least loaded, and quarantine and ``max_ejected_fraction`` never take the last
engines of a role out, so without this rule a dead consumer took every request while a live one,
ejected for stream faults but reachable, was held out by the cap.

Evidence, in the order the supervisor sees it (the last word wins):

* a request leg that could not connect (``engine_unreachable`` with no connection made: the
  report's connect flag) says unreachable; a connection lost before the response head says
  nothing (a pooled connection to an engine that died since was made before it died: taking it
  for a fresh one logged "reachable again" between two refusals of an engine dead throughout);
  any other report naming the engine (a success, a 5xx, a stream fault) says a connection was
  made;
* the supervisor's own control reads (``/health``, ``/metrics``): no connection says
  unreachable, any HTTP answer says reachable; a read that timed out says nothing (a busy
  engine's ``/metrics`` can answer after its short bound);
* a readmission by a probe that passed says reachable (``supervisor.checks``); an operator's
  readmit says nothing of the wire (the next read does).

Why apart from :mod:`.breaker`: reachability is a fact about the wire, not blame. An ambiguous
crossed decode charges nobody, yet the refused connection is the consumer's; an ejected engine's
reports change nothing in its breaker, yet its reachability still moves. Nothing here does I/O.
"""

from __future__ import annotations


class Reachability:
    """The unreachable engines by name; :attr:`version` moves exactly when that set changes."""

    def __init__(self) -> None:
        self._down: set[str] = set()
        self.version = 0
        self.changed: list[tuple[str, bool]] = []  # (engine, reachable) since the supervisor last took them

    def unreachable(self, engine: str) -> bool:
        """Did the engine's last connection attempt fail?"""
        return engine in self._down

    def saw(self, engine: str, reachable: bool) -> None:
        """A connection to ``engine`` was made (``reachable``) or could not be."""
        if reachable == (engine not in self._down):
            return
        if reachable:
            self._down.discard(engine)
        else:
            self._down.add(engine)
        self.version += 1
        self.changed.append((engine, reachable))

    def reported(self, producer: str, consumer: str, ok: bool, failed: str | None, refused: bool,
                 lost: bool = False) -> None:
        """What one worker report says of the engines it names (the module's text): ``refused``,
        no connection could be made to ``failed``; ``lost``, a connection was lost before any
        response (it says nothing)."""
        if ok:
            if self._down:  # the usual case, nobody down: no set work per success
                self.saw(consumer, True)
                self.saw(producer, True)
        elif failed is not None and (refused or not lost):
            self.saw(failed, not refused)

    def forget(self, engine: str) -> None:
        """The engine left the fleet (discovery): nothing is remembered of it."""
        self._down.discard(engine)

    def names(self) -> list[str]:
        """The engines unreachable now."""
        return sorted(self._down)

    def take_changes(self) -> list[tuple[str, bool]]:
        """The changes since the last call, oldest first (the supervisor logs each)."""
        changed, self.changed = self.changed, []
        return changed
