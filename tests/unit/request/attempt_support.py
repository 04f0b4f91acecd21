"""Fakes for driving one attempt (``narwhal.request.attempt.Attempts``) without engines: scripted
decode legs, engines that record prefills, decodes and releases, a client that records what it was
sent, and the breaker reports; ``setup_attempts`` wires them to a real local fleet state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from narwhal.engines import endpoints
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import Signal
from narwhal.errors import EngineError, NarwhalError
from narwhal.fleet import Engine, Fleet
from narwhal.request.admission import ClientRequest
from narwhal.request.attempt import Attempts
from narwhal.request.outcomes import Outcomes
from narwhal.request.slot_wait import WaitingPlacement
from narwhal.settings import Settings
from narwhal.shm.local import LocalFleetState

DESCRIPTOR = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}


@dataclass
class Leg:
    spans: list[bytes]
    fail_at: EngineError | None = None
    closed: bool = False
    relayed: int = 0  # spans a direct relay would have written (none here)
    connect_fault: NarwhalError | None = None  # open() fails before anything was sent
    sent: bool = False

    async def open(self) -> bytes | None:
        if self.connect_fault is not None:
            raise self.connect_fault
        self.sent = True
        return None

    last: bytes = b""

    async def next_span(self) -> bytes | Signal:
        if not self.spans:
            if self.fail_at is not None:
                raise self.fail_at
            return Signal.END
        self.last = self.spans.pop(0)
        return self.last

    @property
    def ended(self) -> bool:  # as DecodeLeg.ended: the span just returned held the terminal event
        return self.last.endswith(b"data: [DONE]\n\n")

    def close(self) -> None:
        self.closed = True


@dataclass
class Engines:
    """Stands in for EngineClient: a prefill answer, then a decode leg (or its refusal)."""

    leg: Leg | None = None
    refuse: EngineError | None = None
    releases: list[str] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)  # consumers a release cannot connect to
    descriptor: dict[str, Any] = field(default_factory=lambda: dict(DESCRIPTOR))
    age_s: float = 0.0  # how old the handoff is when the prefill returns
    legs: int = 0  # decode legs built

    async def prefill(self, producer: Any, endpoint: str, body: Any, **_: Any) -> PrefillResult:
        return PrefillResult(producer=producer.name, producer_url=producer.url, endpoint=endpoint,
                             request_id="r1", descriptor=self.descriptor, started_at=time.monotonic() - self.age_s)

    def decode_leg(self, result: PrefillResult, consumer: Any, body: Any, descriptor: Any, **_: Any) -> Leg:
        self.legs += 1
        if self.refuse is not None:
            raise self.refuse
        assert self.leg is not None
        return self.leg

    async def release(self, result: PrefillResult, consumer: Any, body: Any, **_: Any) -> str:
        self.releases.append(consumer.name)
        return "unreachable" if consumer.name in self.unreachable else "released"


@dataclass
class Client:
    """Stands in for ClientStream: records what the client was sent."""

    committed: bool = False
    written: list[bytes] = field(default_factory=list)
    stream: Any = None
    leave_on_write: bool = False

    def relay_sink(self) -> Any:
        return lambda span: True

    async def commit_stream(self) -> None:
        self.committed, self.stream = True, object()

    async def write(self, data: bytes, *, eof: bool = False) -> None:
        if self.leave_on_write:
            raise ConnectionResetError("gone")
        self.written.append(data)

    async def drain(self) -> None: ...

    async def send_whole(self, body: bytes) -> Any:
        self.committed = True
        self.written.append(body)
        return object()


@dataclass
class Reports:
    seen: list[dict[str, Any]] = field(default_factory=list)

    def report(self, producer: Engine, consumer: Engine, *, error: EngineError | None = None,
               failed: Engine | None = None, before_first_token: bool = False, local: bool = False) -> None:
        self.seen.append({"producer": producer.name, "consumer": consumer.name, "ok": error is None,
                          "reason": None if error is None else error.reason, "before_first_token": before_first_token})

    def quarantine(self, engine: Engine, seconds: float) -> None: ...


def setup_attempts(engines: Engines, consumers: int = 1) -> tuple[Attempts, LocalFleetState, Reports, list[Any]]:
    settings = Settings.model_validate({"engines": [
        {"name": "p0", "url": "http://127.0.0.1:1", "role": "producer", "models": ["m"]},
        *({"name": f"d{i}", "url": f"http://127.0.0.1:{2 + i}", "role": "consumer", "models": ["m"]}
          for i in range(consumers)),
    ]})
    fleet = Fleet(settings)
    state = LocalFleetState(fleet)
    reports = Reports()
    spawned: list[Any] = []
    attempts = Attempts(settings, WaitingPlacement(fleet, state, state, settings.placement), engines,  # type: ignore[arg-type]
                        Outcomes(fleet, reports, 0), spawned.append)
    return attempts, state, reports, spawned


def client_request(stream: bool = True) -> ClientRequest:
    deadline = asyncio.get_running_loop().time() + 30
    return ClientRequest(endpoint=endpoints.COMPLETIONS, body={"model": "m", "prompt": "x"}, model="m", stream=stream,
                         deadline=deadline, forward={})


def held(state: LocalFleetState) -> tuple[list[int], list[int]]:
    return state.both_totals()
