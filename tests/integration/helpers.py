"""Small client-side helpers: send a request through the router and read what came back."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tests.integration.conftest import MODEL


@dataclass
class Reply:
    status: int
    headers: Any
    raw: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def events(self) -> list[bytes]:
        """The data payloads of an SSE body, in order."""
        out = []
        for event in self.raw.split(b"\n\n"):
            if event.startswith(b"data: "):
                out.append(event[6:])
        return out

    @property
    def text(self) -> str:
        """The generated text of a completions or chat stream."""
        parts = []
        for data in self.events:
            if data == b"[DONE]":
                continue
            obj = orjson.loads(data)
            for choice in obj.get("choices", []):
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)


def completion(prompt: str, *, stream: bool = True, max_tokens: int = 4, fake: Any = None, **extra: Any) -> dict:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": max_tokens}
    if fake is not None:
        body["narwhal_fake"] = fake
    body.update(extra)
    return body


def chat(prompt: str, *, stream: bool = True, max_tokens: int = 4, fake: Any = None, **extra: Any) -> dict:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
        "max_tokens": max_tokens,
    }
    if fake is not None:
        body["narwhal_fake"] = fake
    body.update(extra)
    return body


async def send(
    base: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> Reply:
    data: Any = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    if isinstance(data, bytes) and len(data) > 1024 * 1024:
        data = io.BytesIO(data)  # aiohttp warns about large raw bodies
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    async with aiohttp.ClientSession() as session:
        async with session.request(method, base + path, data=data, headers=hdrs) as resp:
            return Reply(resp.status, resp.headers, await resp.read())


def expected_text(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


def error_of(reply: Reply) -> dict[str, Any]:
    body = reply.json
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def terminal_error(reply: Reply) -> dict[str, Any]:
    """The terminal error event of a stream that ended after HTTP 200 (no [DONE] after it)."""
    events = reply.events
    assert events, reply.raw
    assert b"[DONE]" not in events, reply.raw
    last = orjson.loads(events[-1])
    assert set(last) == {"error"}, last
    return last["error"]
