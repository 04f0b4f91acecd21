"""The placement scenarios' load: users whose every request has its own body, and what they measure.

Why not ``perf/load/generator.run_round``: it sends one body to every user, which is right for measuring
a router's cost but says nothing about placement, where what matters is *which* prefix a request
carries. Here each user owns a body source: a multi-turn chat that extends its own history under
one of a few long shared system prompts (``ChatUsers``, the prefix-affinity workload), or the same
fixed body (``FixedBody``). The loop, the window and the tally are ``perf/load``'s own, so the
figures mean what they mean in every other scenario.

The router's own time to the handoff (``ttft_s``) comes from its access log, read from the offset
the round started at (``AccessLog``), so client-felt and router-measured times come from the
same requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from perf.load.generator import (
    CHAT,
    MODEL,
    Groups,
    PdLegs,
    RoundResult,
    _drain,
    _tally,
    _window,
    new_session,
    one_request,
)
from perf.load.reading import Outcome

ASSISTANT = "".join(f" t{i}" for i in range(8))  # what the fake answers to max_tokens 8


def system_prompts(count: int, chars: int, seed: int = 7) -> list[str]:
    """``count`` distinct long system prompts of ``chars`` characters (distinct from the first byte)."""
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10**6):06d}" for _ in range(4096)]
    out = []
    for i in range(count):
        text = f"You are assistant number {i}. "
        while len(text) < chars:
            text += rng.choice(words) + " "
        out.append(text[:chars])
    return out


@dataclass(slots=True)
class _Chat:
    system: int
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0
    limit: int = 0  # turns before the user starts a new chat


def zipf_weights(count: int, s: float) -> list[float]:
    """Popularity of ``count`` prompts, the k-th (from 1) in proportion to k^-s; s = 0 is uniform."""
    raw = [(k + 1) ** -s for k in range(count)]
    total = sum(raw)
    return [w / total for w in raw]


class ChatUsers:
    """Multi-turn chats: each user picks a system prompt, then extends its own history every turn.

    By default every chat has ``turns`` turns and every prompt is as likely. ``weights``: how
    often each prompt starts a chat (e.g. :func:`zipf_weights`); ``multi_turn``: the share of
    chats that are multi-turn, of 2..``turns`` turns (uniform), the others one turn.
    """

    def __init__(
        self, prompts: list[str], turns: int, tokens: int = 8, seed: int = 11,
        weights: Sequence[float] | None = None, multi_turn: float | None = None,
    ) -> None:
        self.prompts = prompts
        self.turns = turns
        self.tokens = tokens
        self.rng = random.Random(seed)
        self.weights = list(weights) if weights is not None else None
        self.multi_turn = multi_turn
        self.chats: dict[int, _Chat] = {}

    def endpoint(self) -> str:
        return CHAT

    def _new_chat(self) -> _Chat:
        rng = self.rng
        if self.weights is None:
            system = rng.randrange(len(self.prompts))
        else:
            system = rng.choices(range(len(self.prompts)), self.weights)[0]
        limit = self.turns
        if self.multi_turn is not None:
            limit = rng.randint(2, self.turns) if rng.random() < self.multi_turn else 1
        chat = _Chat(system, limit=limit)
        chat.messages.append({"role": "system", "content": self.prompts[system]})
        return chat

    def data(self, user: int) -> dict[str, Any]:
        """The user's next request: the next turn of its chat, or the first of a new one."""
        chat = self.chats.get(user)
        if chat is None or chat.turns >= chat.limit:
            chat = self.chats[user] = self._new_chat()
        elif chat.turns:
            chat.messages.append({"role": "assistant", "content": ASSISTANT})
        question = f"user {user} turn {chat.turns}: " + " ".join(
            f"q{self.rng.randrange(10**5)}" for _ in range(30)
        )
        chat.messages.append({"role": "user", "content": question})
        chat.turns += 1
        return {"model": MODEL, "messages": chat.messages, "max_tokens": self.tokens, "stream": True}

    def body(self, user: int) -> bytes:
        return orjson.dumps(self.data(user))

    def system_of(self, user: int) -> int:
        """The system prompt (index) of the user's current chat: what a static assignment keys on."""
        return self.chats[user].system


class FixedBody:
    """Every user sends the same bytes (``perf/load/generator.Workload``'s body)."""

    def __init__(self, endpoint: str, body: bytes) -> None:
        self._endpoint = endpoint
        self._body = body

    def endpoint(self) -> str:
        return self._endpoint

    def body(self, user: int) -> bytes:
        return self._body


# Per user: the decode's full URL and the two legs the load generator sends itself (``direct-pd``).
Legs = Callable[[int], tuple[str, PdLegs]]


async def run_users(
    target: str,
    url: str | Sequence[str],
    source: ChatUsers | FixedBody,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    groups: Groups,
    timeout_s: float = 60.0,
    on_edge: Callable[[], Awaitable[None]] | None = None,
    legs: Legs | None = None,
) -> RoundResult:
    """One closed-loop round: ``concurrency`` users, each sending its own next body when the last
    ends; ``on_edge`` runs as the measured window opens and as it closes.

    Several ``url``s (router replicas): requests alternate between them, whoever sends them, so a
    chat's turns land on different replicas. ``legs``: no router, the load generator runs each
    request's prefill and decode itself where ``legs`` says (``url`` is then unused).
    """
    session = new_session()
    full_urls = [u + source.endpoint() for u in ([url] if isinstance(url, str) else url)]
    sent = 0
    done_at: list[tuple[float, Outcome]] = []
    errors: Counter[str] = Counter()
    stop = False

    async def user(i: int) -> None:
        nonlocal sent
        while not stop:
            if legs is not None:
                decode_url, pd = legs(i)
                out = await one_request(session, decode_url, b"", True, timeout_s, pd)
            else:
                sent += 1
                out = await one_request(session, full_urls[sent % len(full_urls)], source.body(i), True, timeout_s)
            if out.ok:
                done_at.append((time.perf_counter(), out))
            else:
                errors[out.error] += 1
                await asyncio.sleep(0.01)

    tasks = [asyncio.ensure_future(user(i)) for i in range(concurrency)]
    try:
        try:
            before, after = await _window(
                groups, warmup_s, duration_s, lambda: len(done_at) + sum(errors.values()) >= concurrency, on_edge
            )
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        stop = True
        unfinished = await _drain(tasks, 30.0)
    finally:
        await session.close()
    return _tally(target, groups, before, after, done_at, errors, unfinished)


class AccessLog:
    """The JSON lines a router appended to its access log since ``mark``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def since_mark(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        out = []
        for line in data.splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line still being written at the edge of the round
            if isinstance(record, dict):
                out.append(record)
        return out
